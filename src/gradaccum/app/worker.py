"""``python -m gradaccum.app.worker``: the one entry point of the plan's fresh processes.

It reads one request (app/fresh.py) from stdin and answers on stdout: a ``Measure`` builds
its model, then waits for the ``Size`` to measure (``measure.Built``); a ``PlanRun`` makes a
run's plan as ``gradaccum train`` makes it (``planning.window_plan``, with the run's model,
data and phases). Not a command: the planner starts it (``fresh.Child``)."""

from __future__ import annotations

import sys

import torch

from gradaccum.app import fresh
from gradaccum.app.build import build_model, build_optimizer, run_data
from gradaccum.app.config import TrainConfig
from gradaccum.app.measure import Built
from gradaccum.app.planning import as_flags, verifier, window_plan
from gradaccum.app.process import exit_on_end_of_input, quiet_third_parties
from gradaccum.app.recipes import get_recipe, hf_recipe


def main() -> int:
    quiet_third_parties()  # its output is the run's log
    request = fresh.read_request(sys.stdin.readline())
    if isinstance(request, fresh.Measure):
        built = Built(request)
        line = sys.stdin.readline()
        if not line:
            return 0  # never asked: the plan was made without this process
        size = fresh.read_size(line)
        exit_on_end_of_input()
        fresh.answer(built.measure(size))
        return 0
    exit_on_end_of_input()
    try:
        info = plan_run(request)
    except ValueError as err:
        fresh.answer(error=as_flags(str(err)))
        return 2
    fresh.answer(info)
    return 0


def plan_run(request: fresh.PlanRun) -> dict:
    """The plan of a run's configuration, as ``gradaccum train`` makes it, stored in the
    plan cache; the fresh process that verifies it imports and builds while this one does."""
    cfg = TrainConfig.of(**request.config)
    with verifier(cfg) as started:
        src = cfg.source
        recipe = hf_recipe(src.hf_model) if src.hf_model else get_recipe(src.recipe)
        loaded = None
        if request.sequences is not None:
            loaded = torch.load(request.sequences, weights_only=True)
        model = build_model(cfg, recipe, lambda _: None)  # (the run logs its LoRA line)
        recipe, data = run_data(cfg, recipe, loaded)
        optimizer = build_optimizer(cfg, model)
        return window_plan(
            cfg, model, optimizer, recipe, torch.device("cpu"), 0, 1, fresh.say,
            each_rank=False, data=data, here=True, started=started,
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
