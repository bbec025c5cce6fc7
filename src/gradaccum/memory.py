"""Memory: measuring it, and what to do when it runs out.

- ``parse_bytes`` / ``format_bytes``: "2GiB", "1500MB", "123456789".
- ``MemoryMeter``: peak memory above a starting point, on any device. On CUDA it reads the
  caching allocator (``torch.cuda.max_memory_allocated``). On CPU it reads the process's
  resident set (``VmRSS``/``VmHWM`` in /proc/self/status); before each measurement freed
  heap pages are handed back to the OS (``malloc_trim``) and the high-water mark is reset
  (``/proc/self/clear_refs``), so consecutive measurements do not hide behind each other.
- ``saved_activation_bytes``: bytes of the tensors autograd saves for backward, each storage
  counted once and parameters excluded (``torch.autograd.graph.saved_tensors_hooks``).
- ``OOMPolicy``: how ``Accumulator.step`` survives ``torch.OutOfMemoryError``: halve the
  micro-batch size, re-split the same window, replay it; grow back after clean windows.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradaccum.batching import batch_size, split

__all__ = [
    "MemoryMeter",
    "OOMPolicy",
    "format_bytes",
    "inject_oom",
    "parse_bytes",
    "saved_activation_bytes",
    "tensor_bytes",
]

log = logging.getLogger("gradaccum")

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a memory size: an integer number of bytes, or a number with a unit
    (B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _BYTES_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS and unit != "":
            raise ValueError(
                f"cannot read {text!r} as a memory size; give bytes (2000000000) or a number "
                "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024), e.g. 2GiB or 1500MB"
            )
        value = float(match.group(1)) * _UNITS[unit or "b"]
        if not float(value).is_integer() and unit in ("", "b"):
            raise ValueError(f"a number of bytes must be whole, got {text!r}")
        value = int(value)
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among ``tensors`` (any iterable, nested dicts/lists)."""
    seen: dict[int, int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(tensors)
    return sum(seen.values())


@contextlib.contextmanager
def saved_activation_bytes(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the bytes autograd saves for backward inside the block.

    Yields a one-element list that holds the total when the block ends. Each storage counts
    once (a tensor saved by two ops, or two views of one storage); parameters and their
    views are excluded, since they are not activations.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    total[0] = sum(seen.values())


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in {_STATUS}")


def rss_bytes() -> int:
    """The process's resident set size now."""
    return _status_bytes("VmRSS")


class MemoryMeter:
    """Peak memory above a starting point, for one device.

    ``start()`` frees what can be freed and records the baseline; ``peak()`` is the most
    memory in use since, minus that baseline. CUDA: the caching allocator's counters. CPU
    (Linux): resident set size, with the high-water mark reset at ``start()``.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu" and not (_STATUS.exists() and _CLEAR_REFS.exists()):
            raise RuntimeError(
                "measuring CPU memory needs Linux's /proc/self/status and /proc/self/clear_refs"
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"memory can be measured on cpu or cuda, not {self.device.type!r}")
        self.baseline = 0

    def _settle(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        elif _LIBC is not None:
            _LIBC.malloc_trim(0)  # give freed heap pages back, so RSS is what is in use

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return rss_bytes()

    def start(self) -> None:
        self._settle()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
        self.baseline = self.current()

    def peak(self) -> int:
        """Peak bytes in use since ``start()``, above the baseline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            top = torch.cuda.max_memory_allocated(self.device)
        else:
            top = _status_bytes("VmHWM")
        return max(0, top - self.baseline)


def inject_oom(max_fitting_size: int) -> Callable[[int], None]:
    """A fault hook for ``Accumulator(fault_hook=...)``: raises ``torch.OutOfMemoryError`` for
    any micro-batch larger than ``max_fitting_size``, as a device that small would."""
    if isinstance(max_fitting_size, bool) or not isinstance(max_fitting_size, int):
        raise ValueError(f"max_fitting_size must be an integer, got {max_fitting_size!r}")

    def hook(micro_size: int) -> None:
        if micro_size > max_fitting_size:
            raise torch.OutOfMemoryError(
                f"injected: micro-batch of {micro_size} exceeds {max_fitting_size}"
            )

    return hook


@dataclass
class OOMPolicy:
    """Replay a window at half the micro-batch size on out-of-memory; grow back later.

    ``cap`` is the largest micro-batch size allowed now (None: as given). After
    ``grow_after`` clean windows the cap doubles, back up to the sizes the caller gives,
    never above them (those are the plan's limit).
    """

    grow_after: int = 50
    cap: int | None = None
    clean_windows: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.grow_after, bool)
            or not isinstance(self.grow_after, int)
            or (self.grow_after < 1)
        ):
            raise ValueError(f"grow_after must be an integer >= 1, got {self.grow_after!r}")

    def arrange(self, micro_batches: list[Any]) -> list[Any]:
        """The micro-batches to run: each given one, split further if above the cap."""
        if self.cap is None:
            return micro_batches
        out: list[Any] = []
        for mb in micro_batches:
            out.extend(split(mb, self.cap) if batch_size(mb) > self.cap else [mb])
        return out

    def shrink(self, ran: list[Any], window: int) -> int | None:
        """After an OOM: the new cap, or None when the window cannot be split smaller."""
        try:
            largest = max(batch_size(mb) for mb in ran)
        except (TypeError, ValueError):
            return None  # micro-batches that are not tensors cannot be re-split
        if largest <= 1:
            return None
        self.cap = math.ceil(largest / 2)
        self.clean_windows = 0
        log.warning(
            "window %d: out of memory at micro-batch size %d; replaying the window at %d "
            "(every sample once)", window, largest, self.cap,
        )  # fmt: skip
        return self.cap

    def window_done(self, given: list[Any], window: int) -> None:
        """Count a clean window; after ``grow_after`` of them, double the cap."""
        if self.cap is None:
            return
        self.clean_windows += 1
        if self.clean_windows < self.grow_after:
            return
        self.clean_windows = 0
        limit = max(batch_size(mb) for mb in given)
        grown = self.cap * 2
        self.cap = None if grown >= limit else grown
        log.info(
            "window %d: %d clean windows; growing the micro-batch back to %s",
            window, self.grow_after, limit if self.cap is None else self.cap,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "clean_windows": self.clean_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap = state["cap"]
        self.clean_windows = state["clean_windows"]
