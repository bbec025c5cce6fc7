"""The window's arithmetic, written once: the tally of its micro-batches (items and summed
loss), the end (divide the summed gradient once, measure, clip, guard) and what the window
reports (``StepResult``). The Accumulator, the framework windows and the pipeline window
each keep a ``Tally`` and end through ``normalize``: every path computes the same thing.

Backward leaves the window's gradient as a sum over its items. One division by the window's
total (what the sum still carries besides the items, e.g. the fp16 pre-scale, included) makes
it the full-batch mean gradient. The norm is measured on the sum and divided by the same
divisor, since the norm of the mean is the norm of the sum over the divisor; clipping then
follows ``torch.nn.utils.clip_grad_norm_``'s rule on that norm. A non-finite norm means a
non-finite gradient somewhere: the window is skipped and the gradient left alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.loss import check_count, check_loss, tensor_count_total

__all__ = [
    "AccumulatorState",
    "StepResult",
    "Tally",
    "finish",
    "normalize",
    "total_norm",
    "warn_skipped",
]

log = logging.getLogger("gradaccum")

_LOW = (torch.float16, torch.bfloat16)


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


@dataclass(frozen=True)
class StepResult:
    """What one window did.

    ``loss`` is the mean loss per item over the window (None when the window held no item);
    ``grad_norm`` is the global norm of the normalized gradient before clipping (None when
    the window held no item); ``skipped`` is None or why the optimizer did not step.
    """

    loss: float | None
    count: int
    grad_norm: float | None
    stepped: bool
    skipped: str | None
    micro_batches: int
    step: int  # optimizer steps taken so far, this window included
    oom_replays: int = 0  # times this window was replayed at a smaller micro-batch size
    noise_scale: float | None = None  # B_simple so far (with a NoiseScale), else None
    noise_interval: tuple[float, float] | None = None  # its interval (NoiseScale.confidence)


class Tally:
    """The window in progress as numbers: its micro-batches, their item count and summed loss.

    Nothing here waits for the device: a loss is summed where it lives (in float64) and a
    count left on a GPU is read once, in ``totals``, with the others."""

    def __init__(self) -> None:
        self.micro_batches = 0  # recorded so far: the next one's index
        self._count = 0  # counts known on the host
        self._device_counts: list[tuple[int, torch.Tensor]] = []  # (index, count) on a device
        self._loss: torch.Tensor | None = None

    def add(self, loss_sum: Any, count: Any) -> tuple[torch.Tensor, int | torch.Tensor]:
        """One micro-batch's summed loss and item count, checked (an error names the
        micro-batch by its index) and recorded. Returns the two as checked."""
        index = self.micro_batches
        loss_sum, count = check_loss(loss_sum, index), check_count(count, index)
        if isinstance(count, torch.Tensor):
            self._device_counts.append((index, count))
        else:
            self._count += count
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=loss_sum.device)
        self._loss.add_(loss_sum.detach())
        self.micro_batches += 1
        return loss_sum, count

    def totals(self, sync: Any) -> tuple[int, float]:
        """The window's item count and summed loss over every rank (``Sync.totals``: one
        all-reduce of two numbers, none in one process)."""
        count = self._count + tensor_count_total(self._device_counts)
        return sync.totals(count, 0.0 if self._loss is None else self._loss.item())


def normalize(
    grads: list[torch.Tensor],
    total: int,
    sync: Any,
    carried: float = 1.0,
    max_grad_norm: float | None = None,
) -> tuple[float, bool]:
    """The window's one division: ``grads`` (this rank's summed gradient, in place) by the
    global item count ``total`` times what the sum still carries besides the items
    (``carried``: an fp16 pre-scale, a framework's own division), then ``finish``'s norm and
    clip. DDP and FSDP2 hand back the mean over ranks, the sum over them / world, so the
    divisor is over the world as well."""
    divisor = total * carried / sync.world
    return finish(sync.local(grads), divisor, max_grad_norm, sync.norm)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors, the sum of squares in at least fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    # fp32/fp64 in one fused kernel (what clip_grad_norm_ runs); low precision widened per
    # tensor without a copy, so a bf16 gradient's norm is not itself rounded to bf16.
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.dtype in _LOW]
    wide = [g for g in grads if g.dtype not in _LOW]
    if wide:
        norms.extend(torch._foreach_norm(wide))
    if len({(n.device, n.dtype) for n in norms}) > 1:
        norms = [n.to(norms[0].device, torch.float64) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def finish(
    grads: list[torch.Tensor],
    divisor: float,
    max_grad_norm: float | None,
    norm: Callable[[list[torch.Tensor]], torch.Tensor] = total_norm,
) -> tuple[float, bool]:
    """Divide ``grads`` (the window's summed gradient) by ``divisor`` in place and clip them to
    ``max_grad_norm``. Returns the normalized gradient's norm before clipping and whether it
    is finite; a non-finite gradient is left as it is (the window will be skipped).

    ``norm`` measures the global norm (``Sync.norm`` adds the other ranks' shards)."""
    grad_norm = norm(grads).item() / divisor
    if not math.isfinite(grad_norm):
        return grad_norm, False
    if not grads:
        return grad_norm, True
    torch._foreach_div_(grads, divisor)
    if max_grad_norm is not None:
        coef = max_grad_norm / (grad_norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return grad_norm, True


def warn_skipped(
    state: Any, why: str, grad_norm: float | None, scale: float | None, new_scale: float | None
) -> None:
    """One log line for a skipped window: why, its norm, the fp16 loss scale's change."""
    rescaled = f"; loss scale {scale:g} -> {new_scale:g}" if scale else ""
    log.warning(
        "window %d skipped (%s, grad norm %s)%s; %d skipped so far",
        *(state.windows, why, grad_norm, rescaled, state.skipped_windows),
    )
