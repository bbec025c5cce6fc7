"""Exact gradient accumulation inside Lightning's ``Trainer(accumulate_grad_batches=N)``.

Lightning divides each micro-batch's loss by N and steps after N micro-batches (fewer at an
epoch's end). Over padded or uneven micro-batches that is the mean of means, not the
window's mean, and a ragged last window is under-weighted. With the ``ExactAccumulation``
callback, training_step returns its summed loss and item count through ``exact_output``,
and the gradient handed to clipping and the optimizer is the window's item-mean:

    from gradaccum.integrations.lightning import ExactAccumulation, exact_output

    class LM(lightning.LightningModule):
        def training_step(self, batch, batch_idx):
            loss_sum, count = ga.causal_lm_loss(self(batch["input_ids"]), batch["labels"])
            return exact_output(self, loss_sum, count)  # {"loss": loss_sum, "count": count}

    lightning.Trainer(accumulate_grad_batches=4, callbacks=[ExactAccumulation()])

Why ``exact_output`` and not a plain dict: a callback sees a training_step's outputs only in
``on_train_batch_end``, which for a window's last micro-batch runs after the optimizer has
stepped. ``exact_output`` returns the same dict and hands the count to the callback at once.

At ``on_before_optimizer_step`` (after the last backward and Lightning's fp16 unscaling,
before its clipping) the window's gradient is divided once by its global item count, N
(Lightning's division) undone in the same division (``FrameworkWindow``, the engine's
arithmetic). Under DDP the counts are summed over ranks. B_simple, the gradient noise
scale, is logged with ``self.log("b_simple", ...)``.

Refused, with the reason: manual optimization, strategies other than single-device and DDP
(DeepSpeed and FSDP own the reduction and normalization), and a training_step that did not
return through ``exact_output``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from gradaccum.integrations.window import FrameworkWindow, noise_option
from gradaccum.noise import NoiseScale

__all__ = ["ExactAccumulation", "exact_output"]


def exact_output(module: lightning.LightningModule, loss_sum: Any, count: Any) -> dict[str, Any]:
    """``{"loss": loss_sum, "count": count}`` for training_step to return, with the count
    handed to the trainer's ``ExactAccumulation`` before backward."""
    if isinstance(loss_sum, Mapping):
        raise TypeError(
            "exact_output takes (loss_sum, count); named terms need each term's count over "
            "the window before its first backward, and Lightning's loop fetches a window's "
            "micro-batches one at a time: use gradaccum's Accumulator (step(..., counts=fn)) "
            "or its transformers Trainer (counts=fn) for a loss of several terms"
        )
    callbacks = [c for c in module.trainer.callbacks if isinstance(c, ExactAccumulation)]
    if len(callbacks) != 1:
        raise RuntimeError(
            f"exact_output needs exactly one ExactAccumulation in the Trainer's callbacks, "
            f"found {len(callbacks)}: Trainer(..., callbacks=[ExactAccumulation()])"
        )
    callbacks[0]._take(loss_sum, count)
    return {"loss": loss_sum, "count": count}


class ExactAccumulation(lightning.Callback):
    """Makes ``accumulate_grad_batches`` exact: the window's gradient is its item-mean.

    Args:
        noise: a ``NoiseScale`` for the gradient noise scale logged as ``b_simple``; True
            (the default) for ``NoiseScale()``, False for none.
    """

    def __init__(self, noise: NoiseScale | bool = True) -> None:
        self.noise = noise_option(noise)
        self.window: FrameworkWindow | None = None
        self.last: Any = None  # what the last window did (a WindowEnd)
        self._micro: tuple[Any, Any] | None = None

    def _take(self, loss_sum: Any, count: Any) -> None:
        self._micro = (loss_sum, count)  # checked when the window takes them, after backward

    def on_train_start(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        problems = []
        if not pl_module.automatic_optimization:
            problems.append(
                "manual optimization: the module runs its own backward and step; use "
                "gradaccum's Accumulator inside training_step instead"
            )
        strategy = trainer.strategy
        if type(strategy) not in (SingleDeviceStrategy, DDPStrategy):
            problems.append(
                f"strategy {type(strategy).__name__}: only single-device and DDP leave the "
                "gradient's reduction and normalization to Lightning's loop"
            )
        if problems:
            raise ValueError(
                "ExactAccumulation cannot make this run exact:\n  - " + "\n  - ".join(problems)
            )
        self.window = FrameworkWindow(strategy.model, self.noise)

    def on_before_backward(self, trainer: lightning.Trainer, pl_module: Any, loss: Any) -> None:
        if self._micro is None:
            raise RuntimeError(
                "ExactAccumulation: training_step must return exact_output(self, loss_sum, "
                "count) (the count reaches the callback before the optimizer steps)"
            )

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        loss_sum, count = self._micro
        self._micro = None
        if self.noise is None:
            self.window.add(loss_sum, count)
            return
        # The gradient holds the summed losses / N, times the fp16 loss scale while it lasts.
        multiplier = _loss_scale(trainer) / trainer.accumulate_grad_batches
        self.window.add(loss_sum, count, _grads(pl_module), multiplier)

    def on_before_optimizer_step(
        self, trainer: lightning.Trainer, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.last = self.window.end(grads, carried=1 / trainer.accumulate_grad_batches)
        if self.last.b_simple is not None:
            pl_module.log("b_simple", self.last.b_simple, on_step=True, on_epoch=False)


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _loss_scale(trainer: lightning.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler.get_scale() if scaler is not None else 1.0
