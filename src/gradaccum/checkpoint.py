"""Whole-run state at a window boundary: model, optimizer, scheduler, the Accumulator's
counters and policies, and every random generator, so a resumed run is the same run.

A checkpoint is a plain dict of tensors, numbers and strings: it loads with
``torch.load(..., weights_only=True)``. It is taken between windows only: inside one, half a
window's gradient would have to be saved, and a resumed run would differ from the original.
(Activation checkpointing, recomputing activations in backward, is ``gradaccum.recompute``.)

Under FSDP2 each rank holds only its shards of the model and the optimizer: ``state_dict()``
holds them as DTensors (torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``),
which ``torch.distributed.checkpoint`` writes, each rank its own part. ``save_sharded`` and
``load_sharded`` do that for a whole Accumulator in one folder: the shards through DCP, and
each rank's own counters, scheduler and random generators beside them as ``rank-R.pt``. The
folder is read without unpickling anything but DCP's own metadata types and tensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import random
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradaccum.engine import Accumulator

__all__ = [
    "FORMAT",
    "AccumulatorState",
    "load",
    "load_sharded",
    "preserved_rng",
    "rng_state",
    "save",
    "save_sharded",
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
            f"state_dict() called inside a window after {acc._window.tally.micro_batches} "
            "micro-batches; checkpoint between windows so a resumed run is the same run"
        )
    if acc.sync.kind == "fsdp":
        model, optimizer = _sharded_states(acc)
    else:
        # The unwrapped module's (no DDP "module." prefix): loads with or without DDP.
        model, optimizer = acc.sync.inner.state_dict(), acc.optimizer.state_dict()
    scaler = acc.precision.scaler
    return {
        "format": FORMAT,
        "accumulator": asdict(acc.state),
        "model": model,
        "optimizer": optimizer,
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
        _load_sharded_states(acc, state_dict["model"], state_dict["optimizer"])
    else:
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


# -- FSDP2: each rank its shards ------------------------------------------------------------


def _sharded_states(acc: Accumulator) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's shards of the model and of the optimizer's state, keyed by parameter name.
    An optimizer that has not stepped yet has no state, and gives None: torch's helper would
    make one by stepping with zero gradients, which starts AdamW's step count at 1 and so
    changes the first real step's bias correction."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = get_model_state_dict(acc.sync.model)
    if not acc.optimizer.state:
        return model, None
    return model, get_optimizer_state_dict(acc.sync.model, acc.optimizer)


def _load_sharded_states(
    acc: Accumulator, model: Mapping[str, Any], optimizer: Mapping[str, Any] | None
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(acc.sync.model, dict(model))
    if optimizer is None:  # saved before the first step: a fresh optimizer's empty state
        acc.optimizer.state.clear()
    else:
        set_optimizer_state_dict(acc.sync.model, acc.optimizer, dict(optimizer))


def save_sharded(acc: Accumulator, path: str | Path) -> None:
    """An FSDP2 Accumulator's ``state_dict()`` into the folder ``path``: every rank calls it
    (it is collective). The model's and optimizer's shards go through
    ``torch.distributed.checkpoint`` (``.distcp`` files and ``.metadata``); the rest of this
    rank's state (counters, scheduler, scaler, its own random generators) to ``rank-R.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = save(acc)
    shards = {"model": state["model"]}
    if state["optimizer"] is not None:
        shards["optimizer"] = state["optimizer"]
    state["model"] = SHARDED
    state["optimizer"] = None if state["optimizer"] is None else SHARDED
    state["world"] = dist.get_world_size()
    dcp.save(shards, checkpoint_id=path)
    torch.save(state, path / f"rank-{dist.get_rank()}.pt")


def load_sharded(acc: Accumulator, path: str | Path) -> None:
    """Restore what ``save_sharded`` wrote into ``path`` (every rank calls it), with as many
    processes as wrote it: each rank's random generators and data shard are its own."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gradaccum.sync import collective_device

    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    file = path / f"rank-{rank}.pt"
    problem, state = None, {}
    try:
        state = torch.load(file, weights_only=True)
    except Exception as err:  # noqa: BLE001 - missing, damaged or unsafe: the same answer
        problem = (
            f"{file} cannot be read ({type(err).__name__}): this rank's part is missing or damaged"
        )
    if problem is None and state.get("world") != world:
        problem = (
            f"{path} was written by {state.get('world')} processes; this job has {world}: "
            f"resume it with torchrun --nproc-per-node {state.get('world')}"
        )
    # Every rank hears of a problem before any of them enters DCP's collective load.
    flag = torch.tensor([int(problem is not None)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise ValueError(problem or f"{path}: another rank cannot read its part")
    shards = {"model": _sharded_states(acc)[0]}
    if state["optimizer"] == SHARDED:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        shards["optimizer"] = get_optimizer_state_dict(acc.sync.model, acc.optimizer)
    dcp.load(shards, storage_reader=_safe_reader()(path))
    load(acc, {**state, "model": shards["model"], "optimizer": shards.get("optimizer")})


SHARDED = "torch.distributed.checkpoint"  # where rank-R.pt's model and optimizer went


@functools.cache
def _safe_reader() -> type:
    """torch.distributed.checkpoint's file reader, reading .metadata (a pickle) with only
    DCP's own metadata types, torch sizes, dtypes and layouts, and paths: like
    ``torch.load(weights_only=True)``, a checkpoint folder can describe tensors and cannot
    run code. (Tensor data and non-tensor values are read by DCP with weights_only=True.)"""
    import pathlib
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    allowed = {
        **{("torch.distributed.checkpoint.metadata", n): getattr(md, n) for n in md.__all__},
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): md._MEM_FORMAT_ENCODING,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): fs._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "WindowsPath"): pathlib.WindowsPath,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in allowed:
                return allowed[(module, name)]
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which a checkpoint's "
                "metadata never needs; not loaded"
            )

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = Unpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = md.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader
