"""Optimizers whose state the trace cannot run but whose layout is documented: bitsandbytes'
blockwise 8-bit optimizers (``AdamW8bit``, ``PagedAdamW8bit``, ``Lion8bit``, ...), modelled by
the state they create (bitsandbytes/optim/optimizer.py, ``Optimizer2State.init_state`` and
``Optimizer1State.init_state``; docs/planning.md, "Optimizers"). Their step is one CUDA kernel
the trace cannot fake (``optimizer_update_8bit_blockwise``), so ``ga.estimate`` refuses a real
bitsandbytes optimizer and takes ``Blockwise8bit`` in its place.

transformers' ``Adafactor`` needs no model: it is plain torch and the trace runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BLOCK", "PAGED_MIN", "QMAP", "Blockwise8bit", "bitsandbytes_refusal"]

BLOCK = 256  # one float32 absmax per 256 values of each 8-bit state
QMAP = 256  # the dynamic quantization map: 256 float32 values, one per state kind
PAGED_MIN = 100_000  # get_state_buffer: a smaller parameter's state is never paged


class Blockwise8bit(torch.optim.Optimizer):
    """The state of one of bitsandbytes' blockwise 8-bit optimizers, created as its
    ``init_state`` creates it on the first step; the step itself changes nothing (the real one
    is a single in-place kernel, so it allocates nothing).

    ``states``: 2 for the Adam family (``AdamW8bit``: state1 and state2), 1 for ``Lion8bit``,
    ``SGD8bit`` (momentum), ``RMSprop8bit``, ``Adagrad8bit``. Per parameter with at least
    ``min_8bit_size`` values: each state ``uint8`` like the parameter, and a ``float32`` absmax
    per block of 256 values; smaller parameters keep ``float32`` states. One 256-entry
    ``float32`` quantization map per state kind is shared by every parameter. ``paged=True``
    (``PagedAdamW8bit``): the states of parameters of at least 100,000 values live in CUDA
    unified memory (``cudaMallocManaged``), outside the caching allocator; they are listed in
    ``outside_allocator`` (the estimate counts them in the device total, not in allocated or
    reserved)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        states: int = 2,
        paged: bool = False,
        min_8bit_size: int = 4096,
        lr: float = 1e-3,
    ) -> None:
        if states not in (1, 2):
            raise ValueError(f"states must be 1 or 2, got {states!r}")
        if not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be a non-negative integer, got {min_8bit_size!r}")
        super().__init__(params, {"lr": lr})
        self.states, self.paged, self.min_8bit_size = states, paged, min_8bit_size
        self.outside_allocator: list[torch.Tensor] = []
        self._qmaps: list[torch.Tensor] | None = None

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros_like(p, dtype=dtype)
        if self.paged and p.numel() >= PAGED_MIN:
            self.outside_allocator.append(out)
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
        return loss

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        names = [str(i + 1) for i in range(self.states)]
        if p.numel() < self.min_8bit_size:
            for i in names:
                state[f"state{i}"] = self._buffer(p, torch.float32)
            return
        if self._qmaps is None:  # made once (fill_qmap), moved to the device with the first
            self._qmaps = [torch.zeros(QMAP, dtype=torch.float32, device=p.device) for _ in names]
        blocks = -(-p.numel() // BLOCK)
        for i, qmap in zip(names, self._qmaps, strict=True):
            state[f"state{i}"] = self._buffer(p, torch.uint8)
            state[f"qmap{i}"] = qmap
            state[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)


def bitsandbytes_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """One line refusing a real bitsandbytes optimizer (its step is a CUDA kernel the trace
    cannot fake), naming the model to pass instead; None for any other optimizer."""
    cls = type(optimizer)
    if not cls.__module__.startswith("bitsandbytes"):
        return None
    return (
        f"optimizer: bitsandbytes' {cls.__name__} steps in a CUDA kernel the trace cannot run; "
        "pass gradaccum.planning.estimate.optimizers.Blockwise8bit(params, states=2 or 1, "
        "paged=...), its documented state layout, instead"
    )
