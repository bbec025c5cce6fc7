"""`gradaccum plan`: the micro-batch that fits a memory budget, for a built-in recipe."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradaccum.app.cli import options
from gradaccum.app.config import PlanConfig, invalid_configuration
from gradaccum.app.measure import fresh_process_verifier
from gradaccum.app.planner import plan_recipe
from gradaccum.app.process import out, say
from gradaccum.app.report.plots import plan_plot


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan the micro-batch size for a memory budget (measured, not guessed)",
        description="Measure a built-in recipe's memory at a few micro-batch sizes, fit a "
        "line, and print the largest micro-batch that fits the budget with the effective "
        "batch kept exact.",
    )
    options.add_arguments(parser, PlanConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = PlanConfig(**options.given(args, PlanConfig))
    if problems := cfg.problems():
        raise ValueError(invalid_configuration(problems))
    if cfg.plot and not Path(cfg.plot).resolve().parent.is_dir():
        raise ValueError(f"--plot {cfg.plot}: folder {Path(cfg.plot).parent} does not exist")
    # the fresh process that verifies a new plan imports and builds while this one does (a
    # cached plan ends it unasked)
    with fresh_process_verifier(cfg.recipe, cfg.precision, cfg.seed, cfg.meter) as verify:
        recipe, result = plan_recipe(cfg, verify, say)
    try:
        exported = result.export(cfg.export) if cfg.export else None
    except ValueError:
        # An effective batch the framework cannot split equally: the plan is still shown
        # (the one line after it says which effective batches would export)
        if not cfg.json:
            out(result.summary(), "", result.table(), "")
        raise
    plotted = plan_plot(result, cfg.plot) if cfg.plot else None
    if cfg.json:
        table = {"recipe": recipe.name, **result.to_dict()}
        if exported is not None:
            table["export"] = exported.to_dict()
        out(json.dumps(table, indent=2))
    else:
        out(result.summary(), "", result.table())
        if plotted is not None:
            out(f"\nplot: {plotted}")
        if exported is not None:
            out("", str(exported))
    return 0
