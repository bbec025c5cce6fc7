"""An independent meter of live tensor bytes for real CPU runs, to check the memory estimate's
trace against (it shares no code with gradaccum.planning.estimate): every op's outputs are looked at
after the op, each storage is counted once by its data pointer while it lives, and
``weakref.finalize`` takes it off when it is freed. ``peak`` is the highest total seen."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum as ga


class LiveStorages(TorchDispatchMode):
    def __init__(self, *already: torch.Tensor) -> None:
        super().__init__()
        self.by_pointer: dict[int, int] = {}
        self.now = self.peak = 0
        for tensor in already:
            self.count(tensor)

    def count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in self.by_pointer:
            return
        self.by_pointer[pointer] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self.uncount, pointer)

    def uncount(self, pointer: int) -> None:
        self.now -= self.by_pointer.pop(pointer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.count(value)
        return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def measured(
    build,
    sample,
    loss_fn,
    micro_size,
    micro_batches,
    *,
    precision="fp32",
    prepare=None,
    checkpointing=False,
    optimizer=adamw,
):
    """A real run's live-tensor peak over the same two windows the estimate traces."""
    torch.manual_seed(0)
    model = build()
    if prepare is not None:
        model = prepare(model)
    if checkpointing:
        ga.enable_checkpointing(model)
    acc = ga.Accumulator(
        model, optimizer([p for p in model.parameters() if p.requires_grad]), precision=precision
    )
    meter = LiveStorages(*model.parameters(), *model.buffers())
    with meter:
        for _ in range(2):
            acc.step([sample(micro_size) for _ in range(micro_batches)], loss_fn)
    return meter.peak


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes for a run whose storages change size in place: FSDP2 frees an
    unsharded parameter by resizing its storage to 0 and gathers it again into the same
    storage, which ``LiveStorages`` (a storage counted at its birth, uncounted at its death)
    would count whole from the first gather on. Here every storage an op hands out is kept
    (weakly) while it lives, by its identity, and after each op the live bytes are the sum of
    their sizes at that moment; a tensor subclass (FSDP2's DTensor shards) is counted by the
    plain tensors inside it. ``peak`` is the highest sum seen."""

    def __init__(self, *already: torch.Tensor) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.now = self.peak = 0
        for tensor in already:
            self.count(tensor)
        self.measure()

    def count(self, tensor: torch.Tensor) -> None:
        if hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self.count(inner)
            return
        if tensor.device.type == "meta":  # shapes only (DeepSpeed keeps such copies): no bytes
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.storages:
            self.storages[key] = weakref.ref(storage, lambda _, key=key: self.storages.pop(key))

    def measure(self) -> None:
        live = (ref() for ref in list(self.storages.values()))
        self.now = sum(s.nbytes() for s in live if s is not None)
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.measure()  # what changed size between ops (a storage resized) before this one
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.count(value)
        self.measure()
        return out
