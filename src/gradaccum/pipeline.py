"""Pipeline parallelism with exact accumulation: the window's micro-batches are the pipeline's.

A model too deep for one device is cut into stages, one per process, and a batch streams
through them as micro-batches (``torch.distributed.pipelining``: ``PipelineStage`` and its
schedules, GPipe and 1F1B). Its default loss handling has the flaw this library exists to
remove: each micro-batch's loss is a mean and the gradients are divided by the number of
micro-batches, so micro-batches of padded sequences with different token counts are
weighted wrongly.

``PipelineWindow`` runs the schedule with summed losses (``scale_grads=False``): every
stage's gradient is then the sum over the window's items. The last stage's loss function
returns ``(loss_sum, count)``; the window's count reaches every stage in one all-reduce of
two numbers, and each stage divides its gradient once by it, clips by the global norm over
all stages (the sum of their squares) and steps, or every stage skips when the norm is not
finite anywhere. That is ``FrameworkWindow.end`` over ``Sync.pipeline``: the arithmetic of
the Accumulator's ``end_window``, not a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.integrations.window import FrameworkWindow
from gradaccum.sync import Sync
from gradaccum.window import StepResult

__all__ = ["SCHEDULES", "PipelineWindow"]

SCHEDULES = ("gpipe", "1f1b")


class PipelineWindow:
    """One stage's side of exact windows through a pipeline schedule.

    ``stage``: this process's ``torch.distributed.pipelining.PipelineStage``; ``optimizer``:
    over its parameters; ``loss_fn(output, target) -> (loss_sum, count)``: used on the last
    stage (a loss summed over the micro-batch's items and how many there are);
    ``micro_batches``: the window's micro-batches (the schedule cuts the batch along dim 0);
    ``schedule``: "gpipe" or "1f1b"; ``max_grad_norm``: clip to this global norm; ``group``:
    the pipeline's process group (default: the world).
    """

    def __init__(
        self,
        stage: Any,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], tuple[torch.Tensor, Any]],
        micro_batches: int,
        *,
        schedule: str = "gpipe",
        max_grad_norm: float | None = None,
        group: Any = None,
    ) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if (
            isinstance(micro_batches, bool)
            or not isinstance(micro_batches, int)
            or micro_batches < 1
        ):
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.stage, self.optimizer, self.loss_fn = stage, optimizer, loss_fn
        self.micro_batches, self.max_grad_norm = micro_batches, max_grad_norm
        self.window = FrameworkWindow(None, None, sync=Sync.pipeline(group))
        self.steps = 0
        self._losses: list[tuple[torch.Tensor, Any]] = []  # the last stage's, this window
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        # Summed losses, no division by the number of micro-batches: the gradient each stage
        # holds after the schedule is the window's sum over its items.
        self.schedule = kind(stage, micro_batches, loss_fn=self._loss, scale_grads=False)
        self._params = [p for group_ in optimizer.param_groups for p in group_["params"]]

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss_sum, count = self.loss_fn(output, target)
        self._losses.append((loss_sum, count))
        return loss_sum

    def step(self, *inputs: Any, target: Any = None) -> StepResult:
        """One window: the first stage passes the batch's inputs, the last its targets (every
        stage may pass both; each uses its own). Every stage returns the same global loss per
        item, count, norm and decision."""
        args = inputs if self.stage.is_first else ()
        self._losses = []
        if self.stage.is_last:
            self.schedule.step(*args, target=target)
        else:
            self.schedule.step(*args)
        if self.stage.is_last:
            # The schedule's first step also calls the loss once to infer the backward's
            # shapes: the window's micro-batches are the last ones it computed.
            if len(self._losses) < self.micro_batches:
                raise RuntimeError(
                    f"the schedule computed {len(self._losses)} losses for "
                    f"{self.micro_batches} micro-batches"
                )
            for loss_sum, count in self._losses[-self.micro_batches :]:
                self.window.add(loss_sum, count)
        grads = [p.grad for p in self._params if p.grad is not None]
        end = self.window.end(grads, max_grad_norm=self.max_grad_norm)
        skipped = "zero count" if end.count == 0 else None if end.finite else "non-finite gradient"
        if skipped is None:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss=end.loss,
            count=end.count,
            grad_norm=end.grad_norm,
            stepped=skipped is None,
            skipped=skipped,
            micro_batches=self.micro_batches,
            step=self.steps,
        )
