"""`gradaccum check`: does accumulation give this model the large batch's gradient?"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from gradaccum.app.cli import options
from gradaccum.app.recipes import RECIPES, get_recipe, hf_recipe
from gradaccum.diagnose import check


@dataclass(kw_only=True)
class CheckConfig:
    recipe: str = field(
        default="gpt",
        metadata={"help": "built-in model and data to audit", "choices": sorted(RECIPES)},
    )
    hf_model: str | None = field(
        default=None,
        metadata={
            "help": "audit a Hugging Face causal LM from a local directory or config JSON instead",
            "metavar": "PATH",
        },
    )
    batch: int = field(default=16, metadata={"help": "samples in the batch compared"})
    micro_size: int = field(default=4, metadata={"help": "samples per micro-batch"})
    seed: int = field(default=0, metadata={"help": "seed for the model and the batch"})


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="audit: is the accumulated gradient the full batch's, and if not, which modules?",
        description="Compute the full-batch gradient and the accumulated one on the same data "
        "and report the relative error per parameter, the worst layers, a verdict, and every "
        "module that makes accumulation differ from the large batch. Exit status 1 on FAIL.",
    )
    options.add_arguments(parser, CheckConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = CheckConfig(**options.given(args, CheckConfig))
    if cfg.micro_size < 1 or cfg.batch <= cfg.micro_size:
        raise ValueError(
            f"need 1 <= micro_size < batch, got micro_size {cfg.micro_size} and batch {cfg.batch}"
        )
    recipe = hf_recipe(cfg.hf_model) if cfg.hf_model else get_recipe(cfg.recipe)
    torch.manual_seed(cfg.seed)
    model = recipe.build_model()
    model.train()
    batch = recipe.make_data(cfg.seed).batch(0, cfg.batch)
    report = check(model, batch, recipe.loss_fn, cfg.micro_size)
    print(f"{recipe.summary}: batch {cfg.batch}, micro-batches of {cfg.micro_size}")
    print(report.summary())
    return 0 if report.passed else 1
