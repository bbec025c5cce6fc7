"""`gradaccum audit FILE:FUNCTION`: is your own trainer's accumulation the large batch's?"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from gradaccum.app.process import out
from gradaccum.diagnose import audit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="audit your own trainer: one accumulated window against the same samples as one batch",
        description="Build your trainer with FUNCTION from FILE (a function of no arguments "
        "returning a transformers.Trainer or a subclass, TRL's included, configured as you "
        "train; or a Lightning Trainer with its module and data, as the tuple (trainer, "
        "module, dataloader); or a plain loop, as a dict with step (step(model, "
        "micro_batches) runs your window), loss (loss(model, batch): the mean loss), model "
        "and micro_batches), run one accumulated window its way and the same samples as "
        "one batch, and "
        "report the relative error, the ratio to the large batch's gradient and the likely "
        "cause. No optimizer steps; the weights are left as they were. Exit status 1 when "
        "the window is not the large batch's.",
    )
    parser.add_argument("target", metavar="FILE:FUNCTION", help="e.g. train.py:make_trainer")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="relative error within which the window is the large batch's (default 1e-5)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    trainer = _build(args.target)
    if not args.tolerance > 0:
        raise ValueError(f"--tolerance must be positive, got {args.tolerance:g}")
    try:
        if isinstance(trainer, tuple) and len(trainer) == 3:  # Lightning's three parts
            trainer, module, data = trainer
            result = audit(trainer, module=module, data=data, tolerance=args.tolerance)
        elif isinstance(trainer, dict):  # a plain loop: step, loss, model, micro_batches
            wanted = {"step", "loss", "model", "micro_batches", "pad", "join"}
            if odd := sorted(set(trainer) - wanted):
                raise ValueError(
                    f"{args.target}() returned a dict with {', '.join(map(repr, odd))}: a plain "
                    "loop's audit takes step, loss, model and micro_batches (pad, join)"
                )
            result = audit(**trainer, tolerance=args.tolerance)
        else:
            result = audit(trainer, tolerance=args.tolerance)
    except TypeError as err:  # not a trainer the audit knows
        raise ValueError(str(err)) from None
    out(result.summary)
    return 0 if result.passed else 1


def _build(target: str):
    """Import FILE as a module (its folder on the path, as `python FILE` would) and call
    FUNCTION()."""
    file, _, name = target.rpartition(":")
    if not file or not name:
        raise ValueError(
            f"give the trainer as FILE:FUNCTION (e.g. train.py:make_trainer), got {target!r}"
        )
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{file}: no such file")
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: one line, its traceback with --debug
        raise ValueError(
            f"{file} failed to load: {type(err).__name__}: {err} (--debug shows where)"
        ) from err
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{file} has no function {name!r}")
    try:
        return factory()
    except Exception as err:
        raise ValueError(
            f"{target}() failed: {type(err).__name__}: {err} (--debug shows where)"
        ) from err
