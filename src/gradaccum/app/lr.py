"""The learning rate of each window: a pure function of the run's position and the window's
batch, so a resumed or rolled-back run sets exactly what an uninterrupted one would."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradaccum.schedule import lr_factor

__all__ = ["LearningRate"]


class LearningRate:
    """Linear warm-up over ``warmup_steps`` windows, then cosine decay to 10% of ``lr`` over
    the rest of the run (in its own unit: steps, or samples for a run given in samples or
    epochs), times the batch rule (``lr_scaling``) for a window of another size than the
    configured effective batch."""

    def __init__(self, schedule: Any, effective_batch: int, progress: Any) -> None:
        self.lr, self.warmup = schedule.lr, schedule.warmup_steps
        self.rule, self.effective_batch = schedule.lr_scaling, effective_batch
        self.progress = progress

    def __call__(self, size: int) -> float:
        p = self.progress
        step = p.schedule.step
        if step < self.warmup:
            shape = (step + 1) / (self.warmup + 1)
        else:
            if p.total_samples is not None:
                warm = self.warmup * self.effective_batch
                done, total = p.schedule.samples, p.total_samples
            else:
                done, warm, total = step, self.warmup, p.total_steps
            fraction = (done - warm) / max(1, total - warm)
            shape = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, fraction))))
        return self.lr * shape * lr_factor(self.rule, size, self.effective_batch)

    def apply(self, optimizer: torch.optim.Optimizer, size: int) -> float:
        """The next window's rate written into every parameter group; returned."""
        lr = self(size)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
