"""Whole-run state at a window boundary: model, optimizer, scheduler, the Accumulator's
counters and policies, and every random generator, so a resumed run is the same run.

A checkpoint is a plain dict of tensors, numbers and strings: it loads with
``torch.load(..., weights_only=True)``. It is taken between windows only: inside one, half a
window's gradient would have to be saved, and a resumed run would differ from the original.
(Activation checkpointing, recomputing activations in backward, is ``gradaccum.recompute``.)
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradaccum.engine import Accumulator

__all__ = [
    "FORMAT",
    "AccumulatorState",
    "load",
    "preserved_rng",
    "rng_state",
    "save",
    "set_rng_state",
]

FORMAT = "gradaccum.accumulator/1"


@dataclass
class AccumulatorState:
    """Counters that travel with a checkpoint; all are totals since the run began."""

    optimizer_steps: int = 0
    windows: int = 0
    skipped_windows: int = 0
    micro_batches: int = 0
    items: int = 0
    oom_replays: int = 0

    def count_window(self, micro_batches: int, items: int, stepped: bool) -> None:
        self.windows += 1
        self.micro_batches += micro_batches
        self.items += items
        self.optimizer_steps += stepped
        self.skipped_windows += not stepped


def rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from: torch's CPU and (when initialized) CUDA
    generators, Python's ``random``, and numpy's global generator when numpy is installed."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional; its generator is saved when it is there
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state(
            (
                saved["name"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every generator ``rng_state`` knows (CUDA's too, when initialized) is as it was when
    the block ends: plan() and check() run training steps that must leave no trace."""
    before = rng_state()
    try:
        yield
    finally:
        set_rng_state(before)


def save(acc: Accumulator) -> dict[str, Any]:
    """``Accumulator.state_dict()``: everything a resumed run needs to continue bit for bit."""
    if acc.in_window:
        raise RuntimeError(
            f"state_dict() called inside a window after {acc._window.micro_batches} "
            "micro-batches; checkpoint between windows so a resumed run is the same run"
        )
    if acc.sync.kind == "fsdp":
        raise NotImplementedError(
            "state_dict() of an FSDP2-sharded model: save it with "
            "torch.distributed.checkpoint (each rank holds only its shards)"
        )
    scaler = acc.precision.scaler
    return {
        "format": FORMAT,
        "accumulator": asdict(acc.state),
        # The unwrapped module's (no DDP "module." prefix): loads with or without DDP.
        "model": acc.sync.inner.state_dict(),
        "optimizer": acc.optimizer.state_dict(),
        "scheduler": None if acc.scheduler is None else acc.scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "oom": None if acc.oom is None else acc.oom.state_dict(),
        "noise": None if acc.noise is None else acc.noise.state_dict(),
        "rng": rng_state(),
    }


def load(acc: Accumulator, state_dict: Mapping[str, Any]) -> None:
    """``Accumulator.load_state_dict()``: restore what ``save`` wrote, or refuse a checkpoint
    that does not match this Accumulator, saying how, before changing anything."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        got = (
            state_dict.get("format")
            if isinstance(state_dict, Mapping)
            else type(state_dict).__name__
        )
        raise ValueError(
            f"not a gradaccum Accumulator checkpoint (format {got!r}, expected {FORMAT!r})"
        )
    if acc.in_window:
        raise RuntimeError("load_state_dict() called inside a window; call abort_window() first")
    keys = ("accumulator", "model", "optimizer", "scheduler", "scaler", "rng")
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise ValueError(f"checkpoint is missing {', '.join(missing)}")
    for key, mine in (("scheduler", acc.scheduler), ("scaler", acc.precision.scaler)):
        if (state_dict[key] is None) != (mine is None):
            has = "has" if state_dict[key] is not None else "has no"
            raise ValueError(
                f"checkpoint {has} {key} state but this Accumulator has "
                f"{'one' if mine is not None else 'none'}"
            )
    counters = state_dict["accumulator"]
    unknown = set(counters) - {f.name for f in fields(acc.state)}
    if unknown:
        raise ValueError(f"checkpoint has unknown accumulator fields {sorted(unknown)}")
    if acc.sync.kind == "fsdp":
        raise NotImplementedError(
            "load_state_dict() into an FSDP2-sharded model: use torch.distributed.checkpoint"
        )
    acc.sync.inner.load_state_dict(state_dict["model"])
    acc.optimizer.load_state_dict(state_dict["optimizer"])
    if acc.scheduler is not None:
        acc.scheduler.load_state_dict(state_dict["scheduler"])
    if acc.precision.scaler is not None:
        acc.precision.scaler.load_state_dict(state_dict["scaler"])
    acc.state = AccumulatorState(**counters)
    # A policy's state is restored when both the checkpoint and this Accumulator have one: a
    # run may resume with a policy turned on or off.
    if acc.oom is not None and state_dict.get("oom") is not None:
        acc.oom.load_state_dict(state_dict["oom"])
    if acc.noise is not None and state_dict.get("noise") is not None:
        acc.noise.load_state_dict(state_dict["noise"])
    set_rng_state(state_dict["rng"])
