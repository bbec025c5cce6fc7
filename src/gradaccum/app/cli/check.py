"""`gradaccum check`: does accumulation give this model the large batch's gradient?"""

from __future__ import annotations

import argparse

import torch

from gradaccum.app.cli import options
from gradaccum.app.config import CheckConfig, invalid_configuration
from gradaccum.app.process import out
from gradaccum.app.recipes import get_recipe, hf_recipe
from gradaccum.diagnose import check
from gradaccum.diagnose.check import float64_batch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="audit: is the accumulated gradient the full batch's, and if not, which modules?",
        description="Compute the full-batch gradient and the accumulated one on the same data "
        "and report the relative error per parameter, the worst layers, a verdict, and every "
        "module that makes accumulation differ from the large batch. Exit status 1 on FAIL.",
    )
    options.add_arguments(parser, CheckConfig)
    # 0.5's spelling of --micro-batch, still taken
    parser.add_argument("--micro-size", dest="micro_batch", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = CheckConfig(**options.given(args, CheckConfig))
    if problems := cfg.problems():
        raise ValueError(invalid_configuration(problems))
    recipe = hf_recipe(cfg.hf_model) if cfg.hf_model else get_recipe(cfg.recipe)
    torch.manual_seed(cfg.seed)
    model = recipe.build_model()
    model.train()
    batch = recipe.make_data(cfg.seed).batch(0, cfg.batch)
    if cfg.float64:
        model, batch = model.double(), float64_batch(batch)
    report = check(model, batch, recipe.loss_fn, cfg.micro_batch, tolerance=cfg.tolerance)
    out(f"{recipe.summary}: batch {cfg.batch}, micro-batches of {cfg.micro_batch}")
    out(report.summary())
    return 0 if report.passed else 1
