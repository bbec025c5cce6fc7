"""Memory: measuring it, and what to do when it runs out.

- ``parse_bytes`` / ``format_bytes``: "2GiB", "1500MB", "123456789".
- ``MemoryMeter``: peak memory above a starting point, on any device. On CUDA it reads the
  caching allocator (``torch.cuda.max_memory_allocated``). On CPU it reads the process's
  resident set (``VmRSS``/``VmHWM`` in /proc/self/status); before each measurement freed
  heap pages are handed back to the OS (``malloc_trim``) and the high-water mark is reset
  (``/proc/self/clear_refs``), so consecutive measurements do not hide behind each other.
- ``LiveTensorBytes``: on CPU, the peak of live tensor bytes (what CUDA's allocator counters
  report on a GPU), from every op's outputs while it is active. RSS also holds what glibc's
  malloc keeps after a free, which grows with the number of micro-batches although the
  tensors in use do not; this meter tells the two apart. Slow (a Python call per op): for
  measurements, not for training.
- ``saved_activation_bytes``: bytes of the tensors autograd saves for backward, each storage
  counted once and parameters excluded (``torch.autograd.graph.saved_tensors_hooks``).

What to do when memory runs out is ``gradaccum.oom``; recomputing activations to save it is
``gradaccum.recompute``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import math
import re
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LiveTensorBytes",
    "MemoryMeter",
    "Resident",
    "TrainingMemory",
    "format_bytes",
    "parse_bytes",
    "saved_activation_bytes",
    "tensor_bytes",
]

_MAX_BYTES = 2**63  # what torch and the OS count sizes in
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\+?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a memory size: an integer number of bytes, or a number with a unit
    (B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        if str(text).strip().startswith("-"):
            raise ValueError(f"a memory size must be positive, got {text!r}")
        match = _BYTES_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS and unit != "":
            raise ValueError(
                f"cannot read {text!r} as a memory size; give bytes (2000000000) or a number "
                "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024), e.g. 2GiB or 1500MB"
            )
        value = float(match.group(1)) * _UNITS[unit or "b"]
        if not math.isfinite(value) or value >= _MAX_BYTES:
            raise ValueError(f"a memory size must be below 2**63 bytes (8 EiB), got {text!r}")
        if not float(value).is_integer() and unit in ("", "b"):
            raise ValueError(f"a number of bytes must be whole, got {text!r}")
        value = int(value)
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    if value >= _MAX_BYTES:
        raise ValueError(f"a memory size must be below 2**63 bytes (8 EiB), got {text!r}")
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
            if hasattr(obj, "to_local"):  # a DTensor (FSDP2's shard): this rank's part
                obj = obj.to_local()
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
    # (an FSDP2 parameter is a DTensor: its storage is this rank's shard)
    param_ptrs = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }
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


class LiveTensorBytes:
    """Context manager: peak bytes of tensor storages allocated inside it and still alive.

    Each op's new outputs are recorded once per storage; a storage leaves the count when it
    is freed. Tensors that existed before the block are not counted (they are the baseline),
    nor are their views and in-place results (a frozen weight's transpose in backward, a
    parameter updated by the optimizer): an output the op's schema marks as aliasing an
    input is no new memory.
    Works on any device; on CPU it is the counterpart of ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._mode: Any = None

    def _track(self, out: Any) -> None:
        stack = [out]
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._sizes:
                    size = storage.nbytes()
                    self._sizes[key] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, size)
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)

    def _release(self, key: int, size: int) -> None:
        if self._sizes.pop(key, None) is not None:
            self.live -= size

    def __enter__(self) -> LiveTensorBytes:
        # The dispatch-mode hook is the documented way to see every op (FlopCounterMode
        # uses it); it lives in a private module, so it is imported only when measuring.
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self
        fresh: dict[Any, tuple[bool, ...]] = {}  # per op: which outputs are new memory

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                if func not in fresh:
                    fresh[func] = tuple(r.alias_info is None for r in func._schema.returns)
                outs = out if isinstance(out, tuple) else (out,)
                for is_new, value in zip(fresh[func], outs, strict=False):
                    if is_new:
                        meter._track(value)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None


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


METERS = ("auto", "rss", "tensors")


class MemoryMeter:
    """Peak memory above a starting point, for one device.

    ``kind``: "auto" reads CUDA's caching allocator on a GPU and the process's resident set
    on CPU; "rss" forces the resident set (Linux); "tensors" counts live tensor storages
    (``LiveTensorBytes``): deterministic, blind to allocator overheads, slow.

    ``start()`` frees what can be freed and records the baseline; ``peak()`` is the most
    memory in use since, minus that baseline; ``stop()`` ends a "tensors" measurement.
    """

    def __init__(self, device: torch.device | str, kind: str = "auto") -> None:
        self.device = torch.device(device)
        if kind not in METERS:
            raise ValueError(f"meter must be one of {', '.join(METERS)}, got {kind!r}")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"memory can be measured on cpu or cuda, not {self.device.type!r}")
        if kind == "auto":
            kind = "cuda" if self.device.type == "cuda" else "rss"
        if kind == "rss" and not (_STATUS.exists() and _CLEAR_REFS.exists()):
            raise RuntimeError(
                "measuring resident memory needs Linux's /proc/self/status and "
                "/proc/self/clear_refs; use meter='tensors' elsewhere"
            )
        self.kind = kind
        self.baseline = 0
        self._live: LiveTensorBytes | None = None

    def _settle(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        elif _LIBC is not None:
            _LIBC.malloc_trim(0)  # give freed heap pages back, so RSS is what is in use

    def current(self) -> int:
        if self.kind == "cuda":
            return torch.cuda.memory_allocated(self.device)
        if self.kind == "rss":
            return rss_bytes()
        return 0 if self._live is None else self._live.live

    def start(self) -> None:
        self.stop()
        self._settle()
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss":
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
        else:
            self._live = LiveTensorBytes().__enter__()
        self.baseline = self.current()

    def stop(self) -> None:
        if self._live is not None and self._live._mode is not None:
            self._live.__exit__(None, None, None)

    def peak(self) -> int:
        """Peak bytes in use since ``start()``, above the baseline."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            top = torch.cuda.max_memory_allocated(self.device)
        elif self.kind == "rss":
            top = _status_bytes("VmHWM")
        else:
            self.stop()
            return 0 if self._live is None else self._live.peak
        return max(0, top - self.baseline)


class Resident:
    """How far the process's resident set grew over some work, freed pages handed back first
    at both ends: ``with Resident() as r: ...`` then ``r.grown``. 0 on a GPU (CUDA's
    allocator counts what is in use, not what a process once touched) and where there is no
    /proc."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.grown = 0
        self._before = 0

    def _now(self) -> int:
        if self.device.type != "cpu" or not _STATUS.exists():
            return 0
        gc.collect()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)
        return rss_bytes()

    def __enter__(self) -> Resident:
        self._before = self._now()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.grown = max(0, self._now() - self._before)


class TrainingMemory:
    """Peak memory of a training run in the plan's terms, from the moment it is made: CUDA's
    allocator peak on a GPU; on CPU the parameters' and buffers' bytes plus how far the
    resident set rose above this moment (the interpreter and torch are not training).
    Make it once the model and optimizer exist, just before the first step. ``kind``: as
    ``MemoryMeter``'s ("tensors": live tensor bytes, deterministic, slow). ``carried``:
    bytes this process already holds for training from before this moment (what planning
    in this process left resident, ``Resident.grown``: a first step's one-time allocations,
    which a fresh process pays inside its first window), counted in every peak."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str,
        kind: str = "auto",
        *,
        carried: int = 0,
    ) -> None:
        device = torch.device(device)
        try:
            self.meter: MemoryMeter | None = MemoryMeter(device, kind)
        except RuntimeError:  # no /proc: report nothing rather than something wrong
            self.meter = None
        self.resident = 0
        if self.meter is not None:
            self.meter.start()
            # CUDA's allocator already counts the parameters in its baseline; RSS does too,
            # but so does everything else, so on CPU they are counted tensor by tensor.
            self.resident = (
                self.meter.baseline
                if device.type == "cuda"
                else tensor_bytes(list(model.parameters()) + list(model.buffers())) + carried
            )
        self.phases: dict[str, int] = {}  # each phase's highest peak, in these terms
        self._top = 0  # the peak of the phases before the meter's last reset

    def peak(self) -> int:
        """The run's peak so far, every phase included."""
        if self.meter is None:
            return 0
        return max(self._top, self.resident + self.meter.peak())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure what runs inside as the phase ``name`` (training, evaluation,
        checkpoint, export): the peak it reaches, from the same baseline as the run's,
        kept in ``phases`` (the highest of each name). The high-water mark is reset at its
        start (the meter's baseline is not), so a phase is seen apart from the ones before;
        ``peak()`` still covers them all."""
        if self.meter is None or self.meter.kind == "tensors":
            yield
            return
        self._top = self.peak()
        if self.meter.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.meter.device)
        else:
            _CLEAR_REFS.write_text("5")  # VmHWM back to the resident set now
        try:
            yield
        finally:
            reached = self.resident + self.meter.peak()
            self.phases[name] = max(self.phases.get(name, 0), reached)
            self._top = max(self._top, reached)

    def window_done(self) -> None:
        """Between windows on CPU: hand the heap's free pages back to the system. Windows of
        varying shapes (sequences of different lengths) leave freed blocks of sizes the next
        window cannot reuse; kept, they would raise the resident set window by window above
        what the plan measured on windows of one shape."""
        if self.meter is not None and self.meter.kind == "rss" and _LIBC is not None:
            _LIBC.malloc_trim(0)
