"""`gradaccum plan`: the micro-batch that fits a memory budget, for a built-in recipe."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gradaccum.app.cli import options
from gradaccum.app.config import PlanConfig
from gradaccum.app.measure import FreshProcessVerifier, fresh_process_verifier
from gradaccum.app.planner import Planner
from gradaccum.app.process import out, say
from gradaccum.app.recipes import get_recipe
from gradaccum.batching import to_device
from gradaccum.memory import parse_bytes
from gradaccum.plan import Plan, plan
from gradaccum.validate import invalid_configuration


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
        return _run(cfg, verify)


def _run(cfg: PlanConfig, verify: FreshProcessVerifier) -> int:
    recipe = get_recipe(cfg.recipe)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = recipe.build_model().to(device)  # where the verifying process measures too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sample = to_device(recipe.sample_batch(8), device)
    settings = {
        "command": "plan",  # the window alone: train's plans cover its evaluations too
        "recipe": cfg.recipe,
        **{k: getattr(cfg, k) for k in ("effective_batch", "world_size", "margin", "meter")},
        **{k: getattr(cfg, k) for k in ("checkpointing", "precision")},
        "budget": parse_bytes(cfg.budget),
    }
    planner = Planner(
        model, optimizer, sample, device, settings, log=say, replan=cfg.replan
    )  # fmt: skip
    found = planner.stored()
    if found is not None:
        result = found[0]
    else:
        say(f"planning {recipe.name}: {recipe.summary}; probing micro-batch sizes 1, 2, 4, 8")
        result = plan(
            model,
            optimizer,
            sample,
            recipe.loss_fn,
            effective_batch=cfg.effective_batch,
            budget=cfg.budget,
            world_size=cfg.world_size,
            margin=cfg.margin,
            checkpointing=cfg.checkpointing,
            precision=cfg.precision,
            meter=cfg.meter,
            verify=verify,
        )
        planner.keep(result.to_dict())
    try:
        exported = result.export(cfg.export) if cfg.export else None
    except ValueError:
        # An effective batch the framework cannot split equally: the plan is still shown
        # (the one line after it says which effective batches would export)
        if not cfg.json:
            out(result.summary(), "", result.table(), "")
        raise
    plotted = draw(result, cfg.plot) if cfg.plot else None
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


def draw(result: Plan, path: str) -> Path:
    """The plan's plot, written to ``path`` (PNG when it names no format: matplotlib would
    add .png); returns the file written."""
    import matplotlib  # imported here: slow to import, and only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    top = max(result.micro_size, max(p.micro_size for p in result.probes))
    xs = list(range(1, top + 1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [result.predict(x) / mib for x in xs], label="predicted peak")
    ax.scatter(
        [p.micro_size for p in result.probes],
        [(result.base_bytes + p.peak_bytes) / mib for p in result.probes],
        color="black",
        zorder=3,
        label="measured (probes)",
    )
    ax.axhline(result.budget / mib, color="red", linestyle="--", label="budget")
    ax.axhline(
        result.budget * (1 - result.margin) / mib,
        color="red",
        linestyle=":",
        label=f"budget less {result.margin:.0%} margin",
    )
    ax.axvline(
        result.micro_size,
        color="green",
        linestyle="-.",
        label=f"planned micro-batch {result.micro_size}",
    )
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"plan: effective batch {result.effective_batch} on {result.device}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written = Path(path) if Path(path).suffix else Path(path).with_suffix(".png")
    fig.savefig(written, dpi=110)
    plt.close(fig)
    return written
