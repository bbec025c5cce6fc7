"""One planner for `gradaccum plan` and `gradaccum train`: a plan is answered from the plan
cache when one is stored for what it depends on, else made and stored. The commands say what
the plan depends on and how to make it (train's covers the run's evaluations, checkpoints
and exports, and is made in a fresh process on the CPU: app/planning.py; plan's is the window
alone); the cache's key, its reading and its writing are here and in plan_cache.py alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from gradaccum.app import plan_cache
from gradaccum.plan import Plan

__all__ = ["Planner"]


class Planner:
    """The plan of one model and setting. ``settings``: the plan's own arguments (budget,
    margin, meter, checkpointing, precision, effective batch, recipe, ...); ``paths``: the
    files the model and data come from; ``cached=False``: never read or write the cache (a
    plan every rank makes together); ``replan``: make it anew and store it."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sample: Any,
        device: torch.device,
        settings: dict[str, Any],
        paths: tuple[str | None, ...] = (),
        *,
        log,
        replan: bool = False,
        cached: bool = True,
    ) -> None:
        self.log, self.replan = log, replan
        self.parts = (
            plan_cache.signature(model, optimizer, sample, device, settings, paths)
            if cached
            else None
        )

    def stored(self) -> tuple[Plan, dict[str, Any]] | None:
        """The cached plan (said in a line, with where it is and how long it took to read),
        or None: none stored, --replan, or no cache."""
        if self.parts is None or self.replan:
            return None
        began = time.perf_counter()
        found = plan_cache.load(self.parts)
        if found is None:
            return None
        planned, info, path = found
        took = time.perf_counter() - began
        self.log(f"the plan is the cached one ({path}, read in {took:.2f} s; --replan plans again)")
        return planned, info

    def keep(self, info: dict[str, Any]) -> None:
        """A new plan's record (``Plan.to_dict()``) stored for the next run."""
        if self.parts is not None:
            plan_cache.store(self.parts, info)

    def plan(self, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The cached plan's record, else ``make()``'s, stored."""
        found = self.stored()
        if found is not None:
            planned, info = found
            self.log(planned.summary())
            return info
        info = make()
        self.keep(info)
        return info
