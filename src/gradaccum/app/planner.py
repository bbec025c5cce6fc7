"""One planner for `gradaccum plan` and `gradaccum train`: a plan is answered from the plan
cache when one is stored for what it depends on, else measured (``Planner.measure``: the
library's ``plan()`` asked one ``PlanRequest``, the planned size verified in a
fresh process on the CPU, the run's phases when the command has them) and stored. `plan`
plans the window alone (``plan_recipe``); `train` covers its evaluations, checkpoints and
exports too, in a process of its own on the CPU (app/planning.py says when)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gradaccum.app import plan_cache
from gradaccum.batching import to_device
from gradaccum.memory import parse_bytes
from gradaccum.planning import Plan, PlanRequest, plan

if TYPE_CHECKING:
    from gradaccum.app.measure import FreshProcessVerifier

__all__ = ["Planner", "plan_recipe", "recipe_planner"]


class Planner:
    """The plan of one model and setting, answered from the cache before the model is built.
    ``settings``: what the plan depends on beside the files (the plan's own arguments:
    budget, margin, meter, checkpointing, precision, effective batch; the recipe and what
    shapes its model and data); ``paths``: the files the model and data come from;
    ``cached=False``: never read or write the cache (a plan every rank makes together);
    ``replan``: make it anew and store it."""

    def __init__(
        self,
        device: torch.device,
        settings: dict[str, Any],
        paths: tuple[str | None, ...] = (),
        *,
        log,
        replan: bool = False,
        cached: bool = True,
    ) -> None:
        self.log, self.replan = log, replan
        self.parts = plan_cache.signature(device, settings, paths) if cached else None

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

    @staticmethod
    def measure(
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sample: Any,
        loss_fn: Any,
        request: PlanRequest,
        *,
        verify: FreshProcessVerifier | None = None,
        phases: dict[str, Callable[[int], Any]] | None = None,
    ) -> Plan:
        """A new plan, measured on ``model`` and ``sample`` (``verify``: the fresh process
        that measures the planned size; ``phases``: the run's other parts)."""
        return plan(model, optimizer, sample, loss_fn, request, verify=verify, phases=phases)

    def answer(self) -> dict[str, Any] | None:
        """The cached plan's record, its summary said, or None (nothing stored, --replan)."""
        found = self.stored()
        if found is None:
            return None
        planned, info = found
        self.log(planned.summary())
        return info

    def plan(self, make: Callable[[], dict[str, Any]], *, keep: bool = True) -> dict[str, Any]:
        """The cached plan's record, else ``make()``'s, stored (``keep=False``: ``make``
        stores it itself, as train's plan process does)."""
        info = self.answer()
        if info is not None:
            return info
        info = make()
        if keep:
            self.keep(info)
        return info


def recipe_planner(cfg: Any, log) -> tuple[Any, PlanRequest, Planner]:
    """(recipe, request, planner) of `gradaccum plan` (a PlanConfig): everything its plan's
    key needs, known without building the model."""
    from gradaccum.app.recipes import get_recipe, hf_recipe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    request = PlanRequest(
        effective_batch=cfg.effective_batch,
        budget=parse_bytes(cfg.budget),
        margin=cfg.margin,
        meter=cfg.meter,
        checkpointing=cfg.checkpointing,
        precision=cfg.precision,
        world_size=cfg.world_size,
        prefer=cfg.prefer,
    )
    settings = {
        "command": "plan",  # the window alone: train's plans cover its evaluations too
        "recipe": cfg.recipe,
        "hf_model": cfg.hf_model,
        "lora": cfg.lora,
        "seed": cfg.seed,
        **request.to_dict(),
    }
    recipe = hf_recipe(cfg.hf_model) if cfg.hf_model else get_recipe(cfg.recipe)
    planner = Planner(device, settings, (cfg.hf_model,), log=log, replan=cfg.replan)
    return recipe, request, planner


def plan_recipe(cfg: Any, log) -> tuple[Any, Plan]:
    """(recipe, plan) for `gradaccum plan` (a PlanConfig): a built-in recipe's window alone
    (or ``--hf-model``'s, with ``--lora R``), from the cache (before the model is built: a
    hit costs what reading it costs) or measured, on the device training would use (where
    the verifying process measures too)."""
    from gradaccum.app.measure import fresh_process_verifier

    recipe, request, planner = recipe_planner(cfg, log)
    found = planner.stored()
    if found is not None:
        return recipe, found[0]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lora = {"r": int(cfg.lora)} if cfg.lora is not None else None
    # the fresh process that verifies the new plan imports and builds while this one does
    with fresh_process_verifier(
        cfg.recipe, cfg.precision, cfg.seed, cfg.meter, hf_model=cfg.hf_model, lora=lora
    ) as verify:
        torch.manual_seed(cfg.seed)
        model = recipe.build_model()
        if lora is not None:
            from gradaccum.integrations.peft import apply_lora

            model = apply_lora(model, **lora)
        model = model.to(device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        sample = to_device(recipe.sample_batch(8), device)
        log(f"planning {recipe.name}: {recipe.summary}; probing micro-batch sizes 1, 2, 4, 8")
        result = planner.measure(model, optimizer, sample, recipe.loss_fn, request, verify=verify)
    planner.keep(result.to_dict())
    return recipe, result
