"""`gradaccum plan`: the micro-batch that fits a memory budget, for a built-in recipe."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from gradaccum.app.cli import options
from gradaccum.app.config import PlanConfig, invalid_configuration
from gradaccum.app.estimating import estimate_command, render
from gradaccum.app.planner import plan_recipe
from gradaccum.app.planning import train_plan_for
from gradaccum.app.process import out, say
from gradaccum.app.recipes import get_recipe
from gradaccum.app.report.plots import plan_plot
from gradaccum.memory import format_bytes
from gradaccum.planning import Export, Plan
from gradaccum.planning.estimate.band import band, kind_of
from gradaccum.planning.exports import BatchShape, export


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan the micro-batch size for a memory budget (measured, not guessed)",
        description="Measure a built-in recipe's memory at a few micro-batch sizes, fit a "
        "line, time the sizes that fit against each other, and print the fastest micro-batch "
        "that fits the budget (--prefer largest: the largest) with the effective batch kept "
        "exact.",
    )
    options.add_arguments(parser, PlanConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = PlanConfig(**options.given(args, PlanConfig))
    if problems := cfg.problems():
        raise ValueError(invalid_configuration(problems))
    for flag, path in (("--plot", cfg.plot), ("--export-to", cfg.export_to)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: folder {Path(path).parent} does not exist")
    if cfg.estimates(gpu_here := torch.cuda.is_available()) and not gpu_here:
        return estimated(cfg)
    # --export alone: stdout is the framework's file, so a redirect makes the file; the
    # plan, which a person reads, goes to stderr
    to_stderr = cfg.export and not cfg.export_to and not cfg.json
    show = (lambda *lines: say("\n".join(lines))) if to_stderr else out
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (trained := train_plan_for(cfg, device, say)) is not None:
        recipe, result = get_recipe(cfg.recipe), trained
    else:
        recipe, result = plan_recipe(cfg, say)  # (from the cache, or measured)
    try:
        exported = result.export(cfg.export) if cfg.export else None
    except ValueError:
        # An effective batch the framework cannot split equally: the plan is still shown
        # (the one line after it says which effective batches would export)
        if not cfg.json:
            show(result.summary(), "", result.table(), "")
        raise
    plotted = plan_plot(result, cfg.plot) if cfg.plot else None
    if cfg.json:
        table = {"recipe": recipe.name, **result.to_dict()}
        if exported is not None:
            table["export"] = exported.to_dict()
        if cfg.estimate:  # a GPU is here: the estimate beside the measurement
            table["estimate"] = estimate_command(beside(cfg, result.micro_size))
        out(json.dumps(table, indent=2))
        if exported is not None and cfg.export_to:
            _write(cfg.export_to, framework_file(exported))
        return 0
    show(result.summary())
    if result.micro_batches == 1:
        show(_whole_batch(result))
    if exported is not None:  # the export's arithmetic, and why its micro-batch differs
        show(*(f"{cfg.export}: {line}" for line in exported.comments))
    show("", result.table())
    if result.timings:  # --prefer fastest: each size's memory and time
        show("", result.timing_table())
    if plotted is not None:
        show(f"\nplot: {plotted}")
    if exported is not None:
        text = framework_file(exported)
        if cfg.export_to:
            _write(cfg.export_to, text)
            out(f"\n{cfg.export} {_WHAT[cfg.export]}: {cfg.export_to}")
        else:
            out(text.rstrip("\n"))
    if cfg.estimate:  # a GPU is here: the estimate beside the measurement
        out("", *render(estimate_command(beside(cfg, result.micro_size)), None))
    return 0


def _whole_batch(result: Plan) -> str:
    """One micro-batch of the whole per-rank batch, said as such: no accumulation at this
    budget, and (when the line says nothing) that the size was measured, not predicted."""
    measured = result.probes[-1] if result.probes else None
    how = f" (measured at {measured.micro_size}, {measured.kind})" if measured else ""
    line = (
        f"the whole per-rank batch of {result.per_rank_batch} fits in one micro-batch"
        f"{how}: no accumulation at this budget"
    )
    if not result.peak_fit.plausible:
        line += "; the memory line says nothing here, so the size was found by measuring"
    return line


# what each framework's file is, and how it is read
_WHAT = {
    "deepspeed": "config (deepspeed.initialize(config=...) or --deepspeed_config)",
    "transformers": "TrainingArguments (HfArgumentParser(TrainingArguments).parse_json_file)",
    "lightning": "Trainer settings (LightningCLI --config, or L.Trainer(**yaml['trainer']))",
    "accelerate": "Accelerator arguments (Accelerator(**json.load(file)))",
}


def framework_file(exported: Export) -> str:
    """The export as the file its framework reads: DeepSpeed's config (strict JSON), the
    TrainingArguments fields as JSON (what HfArgumentParser.parse_json_file reads),
    Lightning's ``trainer:`` section as YAML (LightningCLI's --config; its DataLoader batch
    size in a comment, the one setting of the user's own code), Accelerator's keyword
    arguments as JSON. What a person reads about it goes elsewhere (``comments``)."""
    if exported.framework == "lightning":
        lines = [
            f"# DataLoader(batch_size={exported.micro_size}): the micro-batch, set where your "
            "data is loaded",
            "trainer:",
            *(f"  {key}: {json.dumps(value)}" for key, value in exported.settings.items()),
        ]
        return "\n".join(lines) + "\n"
    return json.dumps(exported.settings, indent=2) + "\n"


def _write(path: str, text: str) -> None:
    """The file whole or not at all (a temporary sibling, then a rename)."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(text)
    partial.replace(target)


def beside(cfg: PlanConfig, micro_size: int) -> PlanConfig:
    return dataclasses.replace(cfg, micro_batch=micro_size)  # the --micro-batch field


def estimated(cfg: PlanConfig) -> int:
    """The fake-tensor estimate for a GPU that is not here (docs/planning.md): printed, or
    with --export the framework's file for the size it chose (the estimate to stderr, as
    for a measured plan); where nothing fits, the estimate at micro-batch 1 and what would
    fit, then the refusal in one line."""
    result = estimate_command(cfg)
    kind = kind_of(cfg.lora, cfg.quantize or result.get("quantize"))
    if (published := band(kind)) is not None:
        result["band"] = {"kind": kind, **published}
    fits = result["total"] <= result["budget"]
    exported = None
    if cfg.export and fits:
        shape = BatchShape(
            effective_batch=cfg.effective_batch,
            world_size=cfg.world_size,
            micro_size=result["micro_batch"],
            precision=cfg.precision,
            checkpointing=bool(result.get("checkpointing")),
            zero_stage=3 if cfg.shard == "fsdp" else 0,
        )
        exported = export(shape, cfg.export)
    to_stderr = exported is not None and not cfg.export_to and not cfg.json
    show = (lambda *lines: say("\n".join(lines))) if to_stderr else out
    if cfg.json:
        out(
            json.dumps({**result, **({"export": exported.to_dict()} if exported else {})}, indent=2)
        )
    else:
        show(*render(result, result["budget"], cfg.budget_said()))
    if exported is not None:
        show(*(f"{cfg.export}: {line}" for line in exported.comments))
        text = framework_file(exported)
        if cfg.export_to:
            _write(cfg.export_to, text)
            show(f"\n{cfg.export} {_WHAT[cfg.export]}: {cfg.export_to}")
        elif not cfg.json:
            out(text.rstrip("\n"))
    if not fits and (cfg.micro_batch is None or cfg.longest):  # a search found nothing
        where = (
            "at micro-batch 1" if cfg.micro_batch is None else f"at micro-batch {cfg.micro_batch}"
        )
        fitting = [
            a["flag"] for a in result.get("alternatives", ()) if a["total"] <= result["budget"]
        ]
        hint = f"; what fits: {', '.join(fitting)}" if fitting else ""
        raise ValueError(
            f"the estimate {where} is {format_bytes(result['total'])} on {result['gpu']}, over "
            f"the budget ({cfg.budget_said()}){hint}"
        )
    return 0
