"""Mixed precision inside a window: autocast, one GradScaler cycle, fp32 accumulation buffers.

Three choices, each with a memory cost per trainable parameter (P = parameter bytes):

- ``precision="fp32"``: no autocast. Gradients live in ``.grad`` in the parameter dtype.
- ``precision="bf16"``: autocast to bfloat16 around each micro-batch's forward; backward runs
  outside autocast (its ops follow the forward's dtypes). No loss scaling: bf16 has fp32's
  exponent range. No extra parameter memory (activations shrink).
- ``precision="fp16"``: autocast to float16 and a ``torch.amp.GradScaler`` for the device,
  one cycle per *window*: the same scale for every micro-batch, ``unscale_`` once at the
  window's end (before normalization and clipping), ``step``/``update`` once. An overflow
  skips the window and lowers the scale; the scheduler does not step. Parameters must stay
  fp32 (torch's GradScaler refuses fp16 gradients). The scaler holds a few scalars.

``accumulate_dtype`` (default: ``float32`` when a trainable parameter is bf16 or fp16, else
off): after each micro-batch's backward, every low-precision ``.grad`` is added into a
buffer of that dtype and freed, so a window of many micro-batches keeps fp32 accuracy
(bf16 has 8 significant bits: adding 256 equal terms to a bf16 sum stalls). At the window's
end the buffers are normalized, measured and clipped in fp32, then cast once into ``.grad``
for the optimizer: one rounding to the parameter's own precision, instead of one per
micro-batch. Memory: 4 bytes per buffered parameter during the window (freed after the
step), plus the transient low-precision ``.grad`` of one backward (2 bytes). We hand the
optimizer a gradient in the parameter dtype rather than keeping an fp32 master copy of the
parameters: any torch optimizer works unchanged, and a bf16 parameter's update is rounded
to bf16 anyway; an fp32 master copy (4 more bytes per parameter plus an optimizer that
steps it) is a different feature, mixed-precision optimization, not accumulation.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_LOW = (torch.float16, torch.bfloat16)


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for the device (ours, or one the user entered around us)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # a torch without the per-device query: assume on, disable it
        return True


class Precision:
    """The precision policy of one Accumulator (autocast, loss scaling, accumulation dtype)."""

    def __init__(
        self,
        precision: str,
        accumulate_dtype: Any,
        params: list[torch.nn.Parameter],
        device_type: str,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}"
            )
        if accumulate_dtype == "auto":
            low = any(p.dtype in _LOW for p in params)
            accumulate_dtype = torch.float32 if low else None
        elif accumulate_dtype is not None and (
            not isinstance(accumulate_dtype, torch.dtype) or not accumulate_dtype.is_floating_point
        ):
            raise ValueError(
                "accumulate_dtype must be 'auto', None or a floating torch dtype such as "
                f"torch.float32, got {accumulate_dtype!r}"
            )
        problems = []
        if scaler is not None and precision != "fp16":
            problems.append(f"a GradScaler was given but precision is {precision!r}, not 'fp16'")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            problems.append(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if precision == "fp16":
            half = sorted({str(p.dtype) for p in params if p.dtype in _LOW})
            if half:
                problems.append(
                    f"precision='fp16' needs fp32 parameters (torch's GradScaler refuses "
                    f"{'/'.join(half)} gradients); keep the model in fp32 and let autocast run "
                    "the forward in fp16, or use precision='bf16'"
                )
            elif accumulate_dtype is not None:
                problems.append(
                    "precision='fp16' keeps fp32 parameters whose .grad already accumulates in "
                    f"fp32; accumulate_dtype={accumulate_dtype} does not apply (pass None)"
                )
        if problems:
            raise ValueError("; ".join(problems))

        self.name = precision
        self.autocast_dtype: torch.dtype | None = PRECISIONS[precision]
        self.device_type = device_type
        self.accumulate_dtype: torch.dtype | None = accumulate_dtype
        if precision == "fp16" and scaler is None:
            scaler = torch.amp.GradScaler(device_type)
        self.scaler = scaler
        # Parameters whose gradient goes through a buffer: lower precision than the buffer.
        self._buffered = (
            set()
            if accumulate_dtype is None
            else {id(p) for p in params if _bits(p.dtype) < _bits(accumulate_dtype)}
        )
        self._buffers: dict[int, torch.Tensor] = {}
        self._prescale = 1.0
        self.expected: int | None = None  # the count the losses were pre-divided by, if any
        self._grad_out: torch.Tensor | None = None  # that pre-division, as backward's gradient
        self._factors: dict[tuple, tuple[torch.Tensor, float]] = {}  # by (total, dtype, device)
        self._unscaled = False
        # fp16 gradients without a scaler would underflow if losses were pre-divided
        self._fp16_grads = any(p.dtype == torch.float16 for p in params)

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, accumulate_dtype={self.accumulate_dtype})"

    # -- per micro-batch --------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(
        self,
        loss_sum: torch.Tensor,
        count: int | torch.Tensor,
        first: bool,
        params: list[torch.nn.Parameter],
        planned: int | None = None,
    ) -> None:
        """Backward of one micro-batch's summed loss, outside autocast, then buffer the grads.

        ``planned``: how many micro-batches the window will run, when known (``step()``).
        Then the losses are pre-divided by the first micro-batch's count times that number,
        the window's total when micro-batches hold equal counts: the sum then arrives
        normalized and end_window skips its division pass (it still divides when the total
        turns out different). Only for a count already on the host (the Accumulator reads a
        CPU tensor count into an int), so no device sync is added.
        """
        if self.scaler is None and first and planned and not self._fp16_grads:
            expected = count * planned if isinstance(count, int) else 0
            if expected > 0:
                # the factor as the loss's dtype holds it, so carried is what was applied;
                # handed to every micro-batch's backward, and kept for the next window (which
                # usually expects the same total)
                key = (expected, loss_sum.dtype, loss_sum.get_device())
                made = self._factors.get(key)
                if made is None:
                    if len(self._factors) >= 64:
                        self._factors.clear()
                    factor = torch.tensor(1.0 / expected, dtype=loss_sum.dtype)
                    made = self._factors[key] = (factor.to(loss_sum.device), factor.item())
                self._grad_out, self._prescale = made
                self.expected = expected
        # d(loss * s)/d(loss) = s, handed to backward directly: no extra autograd node
        grad_out = self._grad_out
        if grad_out is not None and (
            grad_out.dtype != loss_sum.dtype or grad_out.get_device() != loss_sum.get_device()
        ):
            grad_out = grad_out.to(loss_sum.device, loss_sum.dtype)
        if self.scaler is not None:
            if first:
                # A summed loss has gradients ``count`` times those of a mean loss, which
                # would overflow fp16 at GradScaler's starting scale and skip the first
                # windows. A power-of-two pre-scale from the first micro-batch's count keeps
                # them at mean-loss size and is exact; end_window divides it back out.
                n = max(int(count), 1)
                self._prescale = 2.0 ** -math.floor(math.log2(n))
            loss_sum = self.scaler.scale(loss_sum * self._prescale)
        if _autocast_on(self.device_type):
            with torch.autocast(self.device_type, enabled=False):
                loss_sum.backward(gradient=grad_out)
        else:  # entering and leaving a disabled autocast costs ~6 us a micro-batch (measured)
            loss_sum.backward(gradient=grad_out)
        if self._buffered:
            self._absorb(params)

    def _absorb(self, params: list[torch.nn.Parameter]) -> None:
        assert self.accumulate_dtype is not None
        for p in params:
            if p.grad is None or id(p) not in self._buffered:
                continue
            buffer = self._buffers.get(id(p))
            if buffer is None:
                self._buffers[id(p)] = p.grad.to(self.accumulate_dtype)
            else:
                buffer.add_(p.grad)
            p.grad = None  # the low-precision copy is not needed past this micro-batch

    # -- the window's end -------------------------------------------------------------------

    def accumulated(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The summed gradient of ``p`` so far in this window (buffer or ``.grad``)."""
        return self._buffers.get(id(p), p.grad)

    def gather(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
    ) -> tuple[list[torch.Tensor], float]:
        """Unscale once and return the window's summed gradients (buffers where used) and the
        factor the sum still carries (the fp16 pre-scale), to be divided out with the count."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled = True
        if self._buffers:
            grads = [g for g in (self.accumulated(p) for p in params) if g is not None]
        else:
            grads = [g for p in params if (g := p.grad) is not None]
        return grads, self._prescale

    def loss_multiplier(self) -> float:
        """What the window's losses are multiplied by before backward (pre-division, fp16
        scaling)."""
        if self.scaler is None:
            return self._prescale
        return self._prescale * float(self.scaler.get_scale())

    def scale(self) -> float | None:
        """The loss scale in use (fp16), or None."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def apply(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: bool
    ) -> None:
        """Hand the optimizer its gradient and step (or not); then end the scaler's cycle."""
        if step:
            for p in params:
                buffer = self._buffers.get(id(p))
                if buffer is not None:
                    p.grad = buffer.to(p.dtype)
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler is not None and self._unscaled:
            self.scaler.update()  # lowers the scale after an overflow, grows it on schedule
        self.reset()

    def abort(self) -> None:
        """Drop a window midway; a scaler that already unscaled must end its cycle, or the
        next window's unscale_ is refused."""
        if self.scaler is not None and self._unscaled:
            self.scaler.update()
        self.reset()

    def reset(self) -> None:
        self._buffers.clear()
        self._prescale = 1.0
        self.expected = None
        self._grad_out = None
        self._unscaled = False
