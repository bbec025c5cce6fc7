"""The plan cache: the same command run again starts training at once instead of planning
again (planning measures memory for seconds to minutes).

A plan is kept under ``$XDG_CACHE_HOME/gradaccum/plans/`` (``~/.cache`` without it), one
JSON file per key; ``$GRADACCUM_PLAN_CACHE`` names another folder, or ``off`` turns the
cache off. The key is a hash of everything the plan depends on: the model (each
parameter's and buffer's name, shape, dtype and whether it trains, so a LoRA model differs
from its base), the largest sample batch's shapes (the data's longest sequences), the
recipe, the files of ``--hf-model`` and ``--data`` (size and modification time), the per-rank
effective batch, budget, margin, meter, checkpointing, precision, the device (a GPU's name
and memory), the machine, its thread count, and the versions of Python, torch and
gradaccum. Anything else changed plans again. ``--replan`` plans again regardless (and
stores the new plan); a file that cannot be read is planned over, never trusted."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

from gradaccum import __version__
from gradaccum.batching import map_tensors
from gradaccum.plan import Plan

FORMAT = 2  # 2: train's plans cover the whole run (phases), the window's batch counted


def folder() -> Path | None:
    """``$GRADACCUM_PLAN_CACHE`` (a folder, or ``off``), else ``$XDG_CACHE_HOME/gradaccum/plans``
    (``~/.cache`` without it)."""
    chosen = os.environ.get("GRADACCUM_PLAN_CACHE", "")
    if chosen.lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradaccum" / "plans"


def key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def signature(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sample: Any,
    device: torch.device,
    settings: dict[str, Any],
    paths: tuple[str | None, ...] = (),
) -> dict[str, Any]:
    """What a plan depends on, as JSON: ``settings`` are the plan's own arguments (budget,
    margin, meter, checkpointing, precision, effective batch, recipe); ``paths`` the files
    the model and data come from."""
    shapes: list[Any] = []
    map_tensors(sample, lambda t: shapes.append([list(t.shape), str(t.dtype)]))
    tensors = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        tensors.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    return {
        "format": FORMAT,
        "versions": [platform.python_version(), torch.__version__, __version__],
        "machine": [socket.gethostname(), platform.machine(), torch.get_num_threads()],
        "device": _device(device),
        "model": [type(model).__qualname__, tensors.hexdigest()],
        "optimizer": type(optimizer).__qualname__,
        "sample": shapes,
        "files": [_files(p) for p in paths if p is not None],
        **settings,
    }


def load(parts: dict[str, Any]) -> tuple[Plan, dict[str, Any], Path] | None:
    """The stored plan for ``parts``, or None (none stored, or a file that is not one)."""
    if (where := folder()) is None:
        return None
    path = where / f"{key(parts)}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != parts:  # a hash collision, or a file edited by hand
            return None
        info = stored["plan"]
        return Plan.from_dict(info), info, path
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(parts: dict[str, Any], info: dict[str, Any]) -> Path | None:
    """Keep ``info`` (a plan's ``to_dict()``) for ``parts``; written whole (a temporary file
    renamed), so a crash leaves no half file. A cache that cannot be written is skipped:
    the next run plans again."""
    if (where := folder()) is None:
        return None
    path = where / f"{key(parts)}.json"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": parts, "plan": info}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None
    return path


def _device(device: torch.device) -> list[Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return [str(device), props.name, props.total_memory]
    return [str(device)]


def _files(path: str) -> list[Any]:
    """A file, or a folder's files, as (name, size, modification time): what was read."""
    root = Path(path).resolve()
    found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out: list[Any] = [str(root)]
    for p in found[:10_000]:
        st = p.stat()
        out.append([str(p.relative_to(root)) if p != root else "", st.st_size, st.st_mtime_ns])
    return out
