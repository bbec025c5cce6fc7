"""The same accumulation written four ways, for bench/overhead.py and bench/correctness.py.

Each function runs one window of micro-batches and returns the gradient the optimizer was
handed (read by a step pre-hook on the underlying torch optimizer). The loss comes in as
``mean_loss(model, mb)`` (a per-micro-batch mean, what the peers' docs use) or, for
gradaccum, ``sum_loss(model, mb) -> (sum, count)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import gradaccum as ga


def capture(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[dict] = []

    def hook(opt, args, kwargs):
        seen.append(
            {
                names[id(p)]: p.grad.detach().clone()
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None and id(p) in names
            }
        )

    optimizer.register_step_pre_hook(hook)
    return seen


class HandLoop:
    """The minimal loop: mean loss / N, backward, one step, zero_grad. The lower bound."""

    name = "hand loop"

    def __init__(self, model, optimizer, n: int) -> None:
        self.model, self.optimizer, self.n = model, optimizer, n

    def window(self, micro: list[Any], mean_loss: Callable, sum_loss: Callable) -> None:
        for mb in micro:
            (mean_loss(self.model, mb) / self.n).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Gradaccum:
    name = "gradaccum"

    def __init__(self, model, optimizer, n: int) -> None:
        self.model = model
        self.acc = ga.Accumulator(model, optimizer)

    def window(self, micro: list[Any], mean_loss: Callable, sum_loss: Callable) -> None:
        self.acc.step(micro, sum_loss)


class Accelerate:
    """Accelerate's documented usage: ``with accelerator.accumulate(model)``, the mean loss,
    ``accelerator.backward`` (which divides by gradient_accumulation_steps), step and
    zero_grad inside the block; the optimizer only steps when gradients sync."""

    name = "Accelerate"

    def __init__(self, model, optimizer, n: int) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(gradient_accumulation_steps=n, cpu=True)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def window(self, micro: list[Any], mean_loss: Callable, sum_loss: Callable) -> None:
        # Full windows of n: accumulate() syncs and steps on every n-th call by its own
        # counter. (A ragged last window needs its prepared DataLoader: see correctness.py.)
        for mb in micro:
            with self.accelerator.accumulate(self.model):
                self.accelerator.backward(mean_loss(self.model, mb))
                self.optimizer.step()
                self.optimizer.zero_grad()


class Fabric:
    """Lightning Fabric's documented usage: ``fabric.no_backward_sync`` on all but the last
    micro-batch, loss divided by the number of accumulation steps, step at the end."""

    name = "Lightning Fabric"

    def __init__(self, model, optimizer, n: int) -> None:
        from lightning.fabric import Fabric as _Fabric

        self.fabric = _Fabric(accelerator="cpu", devices=1)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        self.n = n

    def window(self, micro: list[Any], mean_loss: Callable, sum_loss: Callable) -> None:
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with self.fabric.no_backward_sync(self.model, enabled=not last):
                self.fabric.backward(mean_loss(self.model, mb) / self.n)
        self.optimizer.step()
        self.optimizer.zero_grad()


IMPLEMENTATIONS = [HandLoop, Gradaccum, Accelerate, Fabric]
