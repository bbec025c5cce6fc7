"""Mixed precision inside a window: autocast, one GradScaler cycle, fp32 accumulation buffers.

``precision=`` takes a name (``"fp32"``, ``"bf16"``, ``"fp16"``) or a ``Precision`` object for
the settings beyond the name: ``Precision("fp16", scaler=torch.amp.GradScaler(...))`` or
``Precision("bf16", accumulate_dtype=None)``. Three choices, each with a memory cost per
trainable parameter (P = parameter bytes):

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


class Precision:
    """The precision policy of one Accumulator: autocast, loss scaling, accumulation dtype.

    Args:
        name: ``"fp32"`` (no autocast), ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a
            GradScaler, one scaler cycle per window).
        accumulate_dtype: dtype of the buffers that accumulate low-precision gradients across
            the window's micro-batches; ``"auto"`` (default) is ``torch.float32`` when a
            trainable parameter is bf16 or fp16 and off otherwise; ``None`` turns it off.
        scaler: a ``torch.amp.GradScaler`` for ``"fp16"`` (for its init_scale or
            growth_interval); by default one is made for the model's device.

    One object per Accumulator: it holds the window's buffers and the scaler's state.
    """

    def __init__(
        self,
        name: str = "fp32",
        *,
        accumulate_dtype: Any = "auto",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        problems = []
        if name not in PRECISIONS:
            problems.append(
                f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {name!r}"
            )
        if (
            accumulate_dtype != "auto"
            and accumulate_dtype is not None
            and (
                not isinstance(accumulate_dtype, torch.dtype)
                or not accumulate_dtype.is_floating_point
            )
        ):
            problems.append(
                "accumulate_dtype must be 'auto', None or a floating torch dtype such as "
                f"torch.float32, got {accumulate_dtype!r}"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            problems.append(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        elif scaler is not None and name != "fp16":
            problems.append(f"a GradScaler was given but precision is {name!r}, not 'fp16'")
        if name == "fp16" and accumulate_dtype not in ("auto", None):
            problems.append(
                "precision='fp16' keeps fp32 parameters whose .grad already accumulates in "
                f"fp32; accumulate_dtype={accumulate_dtype} does not apply (pass None)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.name = name
        self.autocast_dtype: torch.dtype | None = PRECISIONS[name]
        self.accumulate_dtype: Any = accumulate_dtype
        self.scaler = scaler
        self.device_type: str | None = None  # set by bind()
        self._buffered: set[int] = set()  # parameters whose gradient goes through a buffer
        self._buffers: dict[int, torch.Tensor] = {}
        self._prescale = 1.0
        self._unscaled = False

    @classmethod
    def of(cls, precision: str | Precision) -> Precision:
        return precision if isinstance(precision, Precision) else cls(precision)

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, accumulate_dtype={self.accumulate_dtype})"

    def bind(
        self, params: list[torch.nn.Parameter], device_type: str, sharded: bool = False
    ) -> Precision:
        """Settle what depends on the model's parameters; once, by the Accumulator.
        ``sharded``: an FSDP2 model, which accumulates in its own reduce dtype ("auto" then
        adds no buffers)."""
        if self.device_type is not None:
            raise ValueError(
                "this Precision already serves an Accumulator; give each its own (it holds the "
                "window's buffers and the scaler's state)"
            )
        half = sorted({str(p.dtype) for p in params if p.dtype in _LOW})
        if self.name == "fp16" and half:
            raise ValueError(
                f"precision='fp16' needs fp32 parameters (torch's GradScaler refuses "
                f"{'/'.join(half)} gradients); keep the model in fp32 and let autocast run "
                "the forward in fp16, or use precision='bf16'"
            )
        if self.accumulate_dtype == "auto":
            wanted = half and self.name != "fp16" and not sharded
            self.accumulate_dtype = torch.float32 if wanted else None
        if self.accumulate_dtype is not None:
            bits = torch.finfo(self.accumulate_dtype).bits
            self._buffered = {id(p) for p in params if torch.finfo(p.dtype).bits < bits}
        if self.name == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(device_type)
        self.device_type = device_type
        return self

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
    ) -> None:
        """Backward of one micro-batch's summed loss, outside autocast, then buffer the grads."""
        loss_sum = self.scaled(loss_sum, count, first)
        # Autocast (ours, or one the user entered around us) is for the forward; backward's
        # ops follow the forward's dtypes. Where none is on there is none to leave.
        on = torch.amp.is_autocast_available(self.device_type) and torch.is_autocast_enabled(
            self.device_type
        )
        with torch.autocast(self.device_type, enabled=False) if on else contextlib.nullcontext():
            loss_sum.backward()
        if self._buffered:
            self._absorb(params)

    def scaled(
        self, loss_sum: torch.Tensor, count: int | torch.Tensor, first: bool
    ) -> torch.Tensor:
        """The loss whose backward runs: under fp16, times the window's pre-scale and the
        loss scale; else the summed loss itself. ``first``: the window's first micro-batch."""
        if self.scaler is None:
            return loss_sum
        if first:
            # A summed loss has gradients ``count`` times those of a mean loss, which would
            # overflow fp16 at GradScaler's starting scale and skip the first windows. A
            # power-of-two pre-scale from the first micro-batch's count keeps them at
            # mean-loss size and is exact; the window's one division takes it out.
            self._prescale = 2.0 ** -math.floor(math.log2(max(int(count), 1)))
        return self.scaler.scale(loss_sum * self._prescale)

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
        grads = [g for g in (self.accumulated(p) for p in params) if g is not None]
        return grads, self._prescale

    def loss_multiplier(self) -> float:
        """What the window's losses are multiplied by before backward (fp16 scaling)."""
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
        self._unscaled = False
