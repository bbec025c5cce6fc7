"""An independent meter of live tensor bytes for real CPU runs, to check the memory estimate's
trace against (it shares no code with gradaccum.plan.estimate): every op's outputs are looked at
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
