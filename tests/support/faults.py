"""Faults on demand, for tests of code that must survive them; never shipped in the package.

``inject_oom`` wraps a loss function; ``corrupt_samples`` damages a run's data, reaching the
app through ``train_with_faults``: the run built by the public ``build_run``, its data
wrapped (``FaultyData``), trained by the public ``Trainer``. No seam in shipped code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.batching import batch_size

__all__ = ["FaultyData", "corrupt_samples", "inject_oom", "oom_after", "train_with_faults"]


def inject_oom(loss_fn: Callable[..., Any], max_fitting_size: int) -> Callable[..., Any]:
    """``loss_fn`` on a device that holds ``max_fitting_size`` samples: a micro-batch larger
    than that raises ``torch.OutOfMemoryError`` before its forward, as such a device would."""
    if isinstance(max_fitting_size, bool) or not isinstance(max_fitting_size, int):
        raise ValueError(f"max_fitting_size must be an integer, got {max_fitting_size!r}")

    def wrapped(model: torch.nn.Module, micro_batch: Any) -> Any:
        size = batch_size(micro_batch)
        if size > max_fitting_size:
            raise torch.OutOfMemoryError(
                f"injected: micro-batch of {size} exceeds {max_fitting_size}"
            )
        return loss_fn(model, micro_batch)

    return wrapped


class oom_after:
    """A device that runs out of memory partway through training, inside a framework's own
    loop: once ``module`` has run ``calls`` training forwards, a forward (or, with
    ``phase="backward"``, the backward through its output) over more than
    ``max_fitting_size`` samples (the first dimension of its first input) raises
    ``torch.OutOfMemoryError``, as such a device would. ``faults`` counts the errors raised;
    ``remove()`` takes the fault away."""

    def __init__(
        self, module: torch.nn.Module, calls: int, max_fitting_size: int, phase: str = "forward"
    ) -> None:
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
        self.calls, self.limit, self.phase = calls, max_fitting_size, phase
        self.seen = 0  # training forwards so far
        self.faults = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not module.training:
            return output
        self.seen += 1
        size = len(args[0])
        if self.seen <= self.calls or size <= self.limit:
            return output
        if self.phase == "forward":
            self.faults += 1
            raise torch.OutOfMemoryError(f"injected: forward of {size} exceeds {self.limit}")
        tensor = output if isinstance(output, torch.Tensor) else output[0]

        def fail(grad: torch.Tensor) -> torch.Tensor:
            self.faults += 1
            raise torch.OutOfMemoryError(f"injected: backward of {size} exceeds {self.limit}")

        tensor.register_hook(fail)
        return output

    def remove(self) -> None:
        self.handle.remove()


def corrupt_samples(
    ranges: list[tuple[int, int]], kind: str = "labels", factor: float = 100.0, seed: int = 0
) -> Callable[[int, Any], Any]:
    """A ``faults`` hook for ``train_with_faults``: the samples of the stream whose
    positions fall in ``ranges`` ([first, end) each) are damaged, as bad data would be.
    ``kind`` "labels" draws a wrong label for each (a classifier's class, or every token of
    a language model's labels); "scale" multiplies float inputs by ``factor``."""
    if kind not in ("labels", "scale"):
        raise ValueError(f"kind must be 'labels' or 'scale', got {kind!r}")

    def hook(position: int, batch: Any) -> Any:
        n = batch_size(batch)
        hit = torch.tensor(
            [any(a <= position + i < b for a, b in ranges) for i in range(n)], dtype=torch.bool
        )
        if not hit.any():
            return batch
        gen = torch.Generator().manual_seed(seed * 7919 + position)
        if isinstance(batch, dict):
            batch = dict(batch)
            if kind == "labels":
                labels = batch["labels"].clone()
                high = int(batch["labels"].max()) + 1
                noise = torch.randint(0, max(high, 2), labels[hit].shape, generator=gen)
                labels[hit] = noise
                batch["labels"] = labels
            else:
                raise ValueError("kind 'scale' needs float inputs; a token batch has none")
            return batch
        x, y = batch
        if kind == "labels":
            classes = int(y.max()) + 1
            y = y.clone()
            shift = torch.randint(1, max(classes, 2), y[hit].shape, generator=gen)
            y[hit] = (y[hit] + shift) % max(classes, 2)  # never the right class
        else:
            x = x.clone()
            x[hit] = x[hit] * factor
        return x, y

    return hook


class FaultyData:
    """A run's data (the recipes' ``TaskData``) whose windows pass through ``faults(position,
    batch) -> batch``: the damage a test injects, seen by the run as its own data."""

    def __init__(self, data: Any, faults: Callable[[int, Any], Any]) -> None:
        self.data, self.faults = data, faults

    def batch(self, first: int, size: int) -> Any:
        return self.faults(first, self.data.batch(first, size))

    def __getattr__(self, name: str) -> Any:  # everything else is the data's own
        return getattr(self.data, name)


def train_with_faults(cfg: Any, faults: Callable[[int, Any], Any], log=print) -> dict[str, Any]:
    """``gradaccum.app.train(cfg)`` with ``faults(position, batch) -> batch`` applied to each
    window's samples before they are split: the run built by ``build_run``, its data wrapped
    (``FaultyData``), then trained by ``Trainer``, as ``train`` does."""
    from gradaccum.app import Trainer, build_run

    run = build_run(cfg, log=log)
    run.data = FaultyData(run.data, faults)
    return Trainer(run, log).fit()


def flip_tensor_bit(path, record: int = 0, byte: int = 0, bit: int = 0) -> tuple[str, int]:
    """Flip one bit in the tensor data of a torch.save file, in place, as a disk's or a copy's
    damage would: byte ``byte`` of its ``record``-th tensor record (sorted by name). Returns
    (record name, file offset). The file still loads: only a checksum can tell."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        names = sorted(
            (i for i in archive.infolist() if "/data/" in i.filename and i.file_size > byte),
            key=lambda i: i.filename,
        )
        info = names[record]
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)  # the local file header: name and extra lengths at 26 and 28
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = info.header_offset + 30 + name_len + extra_len + byte
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ (1 << bit)]))
    return info.filename, offset


def rewrite_checkpoint(path, change: Callable[[dict[str, Any]], None]) -> None:
    """A run checkpoint changed by ``change(state)`` and written again with a valid checksum:
    a bad state that no file damage explains (a model the run itself made bad), which only
    judging the state can tell."""
    from pathlib import Path

    from gradaccum.app.checkpoints import Checkpoints, sealed
    from gradaccum.app.folder import RunFolder

    path = Path(path)
    state = Checkpoints(RunFolder(path.parent)).load(torch.device("cpu"), path)
    state.pop("format")
    change(state)
    torch.save(sealed(state), path)
