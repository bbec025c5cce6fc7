"""Trace one stretch of training with fake tensors and record its allocation and free sequence.

``Tally`` is a ``TorchDispatchMode`` entered over torch's ``FakeTensorMode``: every op runs on
fake tensors (shapes, dtypes and strides, no memory, no compute), and each storage an op
creates is recorded when it appears and again when its last reference dies (a weak reference's
callback, which fires the moment the storage is freed, inside the op or autograd's release of
what it saved). What it records is the sequence the device's allocator would see, in order:
``("alloc", serial, bytes)`` and ``("free", serial, bytes)``.

Two questions the trace cannot answer by itself are answered here:

- A host read of a value (``.item()``, ``bool(tensor)``: ``aten._local_scalar_dense``) has no
  value under fake tensors; it is answered with 1 (or True), so a finite-gradient check passes
  and a count is positive: the window steps, which is the path whose memory matters.
- An op without a fake kernel stops the trace with ``TraceError``, naming the op and the module
  whose forward was running.

This module knows nothing of CUDA; the differences between the traced device and CUDA are
``gradaccum.planning.estimate.cuda``'s.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "HostReads",
    "Tally",
    "TraceError",
    "apply_order",
    "fake_mode",
    "module_names",
    "moves_in_place",
]

_SCALAR = torch.ops.aten._local_scalar_dense.default


def live_at(events: list[tuple[str, Any, int]], index: int) -> dict[Any, int]:
    """serial -> bytes of what is live after the first ``index`` of an allocation sequence
    of ``(action, serial, bytes)`` events ("alloc" or a free)."""
    live: dict[Any, int] = {}
    for action, serial, size in events[:index]:
        if action == "alloc":
            live[serial] = size
        else:
            live.pop(serial, None)
    return live


class TraceError(RuntimeError):
    """An op the trace cannot run on fake tensors; ``op`` and ``module`` name where."""

    def __init__(self, op: str, module: str, reason: str) -> None:
        self.op, self.module, self.reason = op, module, reason
        super().__init__(
            f"the memory trace cannot run {op} (in {module}) on fake tensors: {reason}"
        )


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # real tensors made before the trace (a constant, the RNG state that checkpointing saves)
    # may meet fake ones
    return FakeTensorMode(allow_non_fake_inputs=True)


def _answer(func, args) -> Any:
    """A host read's answer under fake tensors (see the module's docstring)."""
    dtype = args[0].dtype
    return True if dtype == torch.bool else 1 if not dtype.is_floating_point else 1.0


class HostReads(TorchDispatchMode):
    """Answers host reads and nothing else: for building the model, which is not traced. A
    yes-or-no read answers no here: initialisers resample ``while (x out of range).any()``,
    and a yes would never end."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR:
            return False if args[0].dtype == torch.bool else _answer(func, args)
        return func(*args, **(kwargs or {}))


class Tally(TorchDispatchMode):
    """The allocation sequence of what runs under it (see the module's docstring).

    ``events``: ``(action, serial, bytes)``; ``tags``: serial -> what the storage is
    ("parameters", "gradients", "optimizer state", "activations"), given by ``tag``;
    the rest are temporaries; ``shapes``: serial -> the shape of the tensor it was made for;
    ``ops``: serial -> the op that made it, where an op did.
    ``peak``/``peak_index``: the live bytes' peak and the number of events up to it."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.tags: dict[int, str] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}  # serial -> the shape it was made with
        self.ops: dict[int, str] = {}  # serial -> the op that made it ("mm.default")
        self.current = self.peak = self.peak_index = 0
        self._live: dict[int, tuple[int, int, Any]] = {}  # id(storage) -> serial, bytes, ref
        self._serial = 0
        self.module = "the model's forward"  # whose forward is running, for TraceError
        self.steady = False  # the second window's events the first's repeated

    @classmethod
    def of(cls, events: list[tuple[str, int, int]], tags: dict[int, str]) -> Tally:
        """A finished trace's record rebuilt from its events and tags (no op runs under it)."""
        out = cls()
        out.events, out.tags = events, tags
        for index, (action, _, size) in enumerate(events, 1):
            out.current += size if action == "alloc" else -size
            if out.current > out.peak:
                out.peak, out.peak_index = out.current, index
        return out

    # -- recording ----------------------------------------------------------------------------

    def record(self, tensor: torch.Tensor, op: Any = None) -> int | None:
        """The serial of ``tensor``'s storage, recorded as allocated (by ``op``, where an op
        made it) if it is new."""
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
            return None
        key = id(storage)
        held = self._live.get(key)
        if held is not None:
            return held[0]
        serial, size = self._serial, storage.nbytes()
        self._serial += 1
        self._live[key] = (serial, size, weakref.ref(storage, lambda _, key=key: self._free(key)))
        self.events.append(("alloc", serial, size))
        self.shapes[serial] = tuple(tensor.shape)
        if op is not None:
            self.ops[serial] = getattr(op, "__name__", str(op))
        self.current += size
        if self.current > self.peak:
            self.peak, self.peak_index = self.current, len(self.events)
        return serial

    def _free(self, key: int) -> None:
        serial, size, _ = self._live.pop(key)
        self.events.append(("free", serial, size))
        self.current -= size

    def tag(self, tensor: torch.Tensor | None, kind: str) -> None:
        if isinstance(tensor, torch.Tensor):
            serial = self.record(tensor)
            if serial is not None:
                self.tags.setdefault(serial, kind)

    def live_at(self, index: int) -> dict[int, int]:
        """serial -> bytes of the storages live after the first ``index`` events."""
        return live_at(self.events, index)

    # -- a window repeated ------------------------------------------------------------------

    def repeated(self, start: int, end: int) -> list[tuple[str, int, int]] | None:
        """The events ``events[start:end]`` (one window) would make again, in a window that
        runs the same ops: each allocation and free again, under new serials, less what the
        window allocated and left alive (optimizer state, accumulation buffers: made once,
        kept). None where the window freed a storage it did not allocate: a second window
        would free what the first left, which its events cannot say."""
        mine = {serial for action, serial, _ in self.events[start:end] if action == "alloc"}
        if any(a != "alloc" and s not in mine for a, s, _ in self.events[start:end]):
            return None
        kept = set(live_at(self.events[start:end], end - start))
        return [e for e in self.events[start:end] if e[1] not in kept]

    def repeat(self, start: int, end: int) -> bool:
        """Append ``repeated(start, end)`` as the next window's events (new serials, the same
        tags and shapes; the live bytes and the peak followed); False, appending nothing,
        where the window cannot be repeated so."""
        again = self.repeated(start, end)
        if again is None:
            return False
        renamed: dict[int, int] = {}
        for action, serial, size in again:
            if action == "alloc":
                new = renamed[serial] = self._serial
                self._serial += 1
                if serial in self.tags:
                    self.tags[new] = self.tags[serial]
                self.shapes[new] = self.shapes.get(serial, ())
                if serial in self.ops:
                    self.ops[new] = self.ops[serial]
                self.events.append(("alloc", new, size))
                self.current += size
                if self.current > self.peak:
                    self.peak, self.peak_index = self.current, len(self.events)
            else:
                self.events.append(("free", renamed[serial], size))
                self.current -= size
        return True

    def same_window(self, first: tuple[int, int], second: tuple[int, int]) -> bool:
        """Whether the events of ``second`` are those of ``first`` repeated (each event's
        action, bytes and tag, in order): a trace of both windows shows whether a window of
        this training may be traced once and repeated."""
        again = self.repeated(*first)
        if again is None:
            return False

        def shape(events):
            return [(a, size, self.tags.get(s)) for a, s, size in events]

        return shape(again) == shape(self.events[second[0] : second[1]])

    # -- the ops ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR:
            return _answer(func, args)
        try:
            out = func(*args, **kwargs)
        except (TraceError, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 (any failure of a fake kernel names its op)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TraceError(str(func), self.module, reason[:200]) from err
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.record(value, func)
        return out


def module_names(model: torch.nn.Module, tally: Tally) -> contextlib.AbstractContextManager:
    """Keep ``tally.module`` naming the innermost module whose forward runs."""

    @contextlib.contextmanager
    def hooks() -> Iterator[None]:
        names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        stack: list[str] = []

        def pre(module, _args):
            stack.append(tally.module)
            tally.module = f"{names.get(id(module), '?')} ({type(module).__name__})"

        def post(_module, _args, _out):
            tally.module = stack.pop() if stack else "the model's forward"

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            tally.module = "backward or the optimizer step"

    return hooks()


def apply_order(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers in the order ``model.to(device)`` allocates them on the device
    (``Module._apply``: children first, then the module's own parameters, then its buffers)."""
    out: list[torch.Tensor] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        out.extend(p for _, p in module.named_parameters(recurse=False))
        out.extend(b for _, b in module.named_buffers(recurse=False))

    visit(model)
    return out


@contextlib.contextmanager
def moves_in_place() -> Iterator[None]:
    """``Module.to(device, dtype)`` that replaces what it converts instead of swapping it.

    Under fake tensors, ``Module.to`` swaps each parameter with its converted self, and the
    swap refuses a tensor the fake mode holds a weak reference to (PEFT moves each new adapter
    to its base layer's device and dtype so). Here each converted parameter becomes a new
    ``Parameter`` (tied ones stay tied) and each converted buffer a new buffer; one that needs
    no conversion is left as it is."""
    original = torch.nn.Module.to

    def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        done: dict[int, torch.Tensor] = {}

        def convert(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in done:
                floating = t.is_floating_point() or t.is_complex()
                new = t.to(device=device or t.device, dtype=dtype if dtype and floating else None)
                if new is not t and isinstance(t, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                done[id(t)] = new
            return done[id(t)]

        for sub in module.modules():
            for name, tensor in [
                *sub.named_parameters(recurse=False),
                *sub.named_buffers(recurse=False),
            ]:
                new = convert(tensor)
                if new is not tensor:
                    setattr(sub, name, new)
        return module

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original
