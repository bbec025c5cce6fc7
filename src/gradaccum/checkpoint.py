"""Checkpoints around the Accumulator's own ``state_dict()`` (engine.py: model, optimizer,
scheduler, counters, policies): every random generator, so a resumed run is the same run,
and the sharded files of FSDP2.

A checkpoint is a plain dict of tensors, numbers and strings: it loads with
``torch.load(..., weights_only=True)``. It is taken between windows only: inside one, half a
window's gradient would have to be saved, and a resumed run would differ from the original.
(Activation checkpointing, recomputing activations in backward, is ``gradaccum.recompute``.)

Under FSDP2 each rank holds only its shards of the model and the optimizer: ``state_dict()``
holds them as DTensors (``FSDPSync.state_dicts``: torch's ``get_model_state_dict`` /
``get_optimizer_state_dict``), which ``torch.distributed.checkpoint`` writes, each rank its
own part. ``save_sharded`` and ``load_sharded`` do that for a whole Accumulator in one
folder: the shards through DCP, and each rank's own counters, scheduler and random
generators beside them as ``rank-R.pt``. The folder is read without unpickling anything but
DCP's own metadata types and tensors.

``state_digest`` is a checkpoint's checksum: SHA-256 over its structure, every value and
every tensor's bytes, so a flipped bit anywhere in what a resume would use is found before
it is used. ``file_digest`` is a file's, for what DCP writes.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradaccum.engine import Accumulator

__all__ = [
    "FORMAT",
    "check_state",
    "saved_state",
    "file_digest",
    "state_digest",
    "load_sharded",
    "preserved_rng",
    "rng_state",
    "save_sharded",
    "set_rng_state",
]

FORMAT = "gradaccum.accumulator/1"


def state_digest(state: Any) -> str:
    """SHA-256 of ``state`` (nested dicts, lists and tuples of tensors, numbers, strings and
    None), as hex: the same for a state and its ``torch.load``-ed copy on any device, and
    different when one bit of a value or a tensor differs."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            # The tensor's bytes, read in place (no copy, and no numpy: the library needs
            # torch alone); ``t`` stays alive while they are read.
            digest.update(
                (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
            )
    elif isinstance(obj, Mapping):
        digest.update(f"D{len(obj)};".encode())
        for key in sorted(obj, key=repr):
            digest.update(f"{key!r}:".encode())
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(f"L{len(obj)};".encode())
        for item in obj:
            _feed(digest, item)
    else:  # numbers, strings, None: repr is exact for floats
        digest.update(f"{type(obj).__name__}:{obj!r};".encode())


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes, as hex, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


# -- the scaffolding every runner's checkpoint shares -------------------------------------------


def saved_state(format: str, counters: Any, scaler: Any, **parts: Any) -> dict[str, Any]:
    """A window runner's checkpoint (the Accumulator's, a pipeline stage's): its ``format``,
    its counters (a dataclass), its own ``parts`` (model, optimizer, ...), the fp16 loss
    scaler's state (None without one) and every random generator's."""
    return {
        "format": format,
        "accumulator": dataclasses.asdict(counters),
        **parts,
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": rng_state(),
    }


def check_state(
    state_dict: Any,
    format: str,
    what: str,
    counters: type,
    parts: tuple[str, ...],
    held: Mapping[str, Any],
) -> None:
    """Refuse a checkpoint that ``saved_state`` did not write for this runner, before anything
    changes: another ``format`` (``what`` names the runner's kind), one of its ``parts``
    missing, a part that is this runner's or None (``held``: name -> this runner's) in one
    and not the other, counters of another version."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != format:
        got = (
            state_dict.get("format")
            if isinstance(state_dict, Mapping)
            else type(state_dict).__name__
        )
        kind, _, number = str(got).rpartition("/")
        mine = format.rpartition("/")
        if kind == mine[0] and number.isdigit() and int(number) > int(mine[2]):
            from gradaccum import __version__

            raise ValueError(
                f"its {what} state is of format {got}, newer than this gradaccum "
                f"({__version__}) reads ({format}): load it with the gradaccum that wrote it "
                "or newer"
            )
        raise ValueError(f"not a gradaccum {what} checkpoint (format {got!r}, expected {format!r})")
    missing = [k for k in ("accumulator", *parts, *held, "rng") if k not in state_dict]
    if missing:
        raise ValueError(f"checkpoint is missing {', '.join(missing)}")
    for key, mine in held.items():
        if (state_dict[key] is None) != (mine is None):
            has = "has" if state_dict[key] is not None else "has no"
            raise ValueError(
                f"checkpoint {has} {key} state but this {what} has "
                f"{'one' if mine is not None else 'none'}"
            )
    unknown = set(state_dict["accumulator"]) - {f.name for f in dataclasses.fields(counters)}
    if unknown:
        raise ValueError(f"checkpoint has unknown accumulator fields {sorted(unknown)}")


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every generator ``rng_state`` knows (CUDA's too, when initialized) is as it was when
    the block ends: plan() and check() run training steps that must leave no trace."""
    before = rng_state()
    try:
        yield
    finally:
        set_rng_state(before)


# -- FSDP2: each rank its shards ------------------------------------------------------------


def save_sharded(acc: Accumulator, path: str | Path) -> None:
    """An FSDP2 Accumulator's ``state_dict()`` into the folder ``path``: every rank calls it
    (it is collective). The model's and optimizer's shards go through
    ``torch.distributed.checkpoint`` (``.distcp`` files and ``.metadata``); the rest of this
    rank's state (counters, scheduler, scaler, its own random generators) to ``rank-R.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = acc.state_dict()
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
    if problem is None:
        try:  # DCP would log each refusal with its traceback, then raise its own
            safe_reader()(path).read_metadata()
        except Exception as err:  # noqa: BLE001 - damaged or unsafe: the same answer
            reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            problem = (
                f"{path / '.metadata'} cannot be read safely ({reason[:200]}); it is damaged "
                "or was changed outside gradaccum: restore it, or start a new run"
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
    shards = {"model": acc.sync.state_dicts(acc.optimizer)[0]}
    if state["optimizer"] == SHARDED:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        shards["optimizer"] = get_optimizer_state_dict(acc.sync.model, acc.optimizer)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(shards, storage_reader=safe_reader()(path))
    except (Exception, CheckpointException) as err:  # (DCP's is a BaseException)
        # Every rank reads the same .metadata: each fails alike, and says so in one line.
        first = next(iter(getattr(err, "failures", {}).values()), err)
        cause = (str(first).strip().splitlines() or [type(first).__name__])[-1]
        raise ValueError(
            f"{path} cannot be read safely as this run's shards ({cause[:200]}); it is "
            "damaged or was changed outside gradaccum: restore it, or start a new run"
        ) from None
    acc.load_state_dict({**state, "model": shards["model"], "optimizer": shards.get("optimizer")})


SHARDED = "torch.distributed.checkpoint"  # where rank-R.pt's model and optimizer went


@functools.cache
def safe_reader() -> type:
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
