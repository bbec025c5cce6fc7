"""`gradaccum train`: parse the flags, resolve them with a config file and a resumed run's
configuration into a TrainConfig (config.resolve_train), then train."""

from __future__ import annotations

import argparse
from pathlib import Path

from gradaccum.app import Interrupted, TrainConfig, train
from gradaccum.app.cli import options
from gradaccum.app.config import resolve_train
from gradaccum.app.folder import INCIDENTS, RunFolder
from gradaccum.app.launch import is_main, resume_command, shutdown, together_then_leave
from gradaccum.app.process import say


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a built-in recipe or a local Hugging Face model with an exact large batch",
        description="Plan the micro-batch for a memory budget, then train with one exact "
        "optimizer step per effective batch. With no options: a byte-level GPT on the Python "
        "standard library's own source.",
    )
    options.add_arguments(parser, TrainConfig)
    parser.set_defaults(run=run)


def resolve(args: argparse.Namespace) -> TrainConfig:
    """The run's configuration from the flags given (config.resolve_train: defaults, a
    resumed run's config, a config file, the flags)."""
    return resolve_train(options.given(args, TrainConfig))


def guard_stop(folder: Path) -> str:
    """What to do after the guard stopped a run: its last incident says why."""
    incidents = folder / INCIDENTS
    last = RunFolder(folder).lines(INCIDENTS)[-1:] if incidents.is_file() else []
    if last and last[0].get("kind") == "divergence":
        return (
            f"gradaccum: the loss diverged in the warm-up (see {incidents}); start a new run "
            "with a lower --lr (or longer --warmup-steps)"
        )
    return (
        f"gradaccum: the incident guard stopped the run (see {incidents}); to train through "
        f"it: {resume_command(folder)} --no-guard"
    )


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    try:
        summary = train(cfg)
        if summary.get("stopped_by") == "guard":  # it gave up: the run did not finish
            if is_main():
                say(guard_stop(Path(summary["run_folder"])))
            return 1
    except Interrupted as stop:
        if is_main():  # every rank stops; one says so, and the others wait until it has
            say(f"\n{stop}")
        together_then_leave()
        return 128 + stop.signum
    finally:
        shutdown()  # leave a torchrun job's process group cleanly (no-op otherwise)
    return 0
