"""Tiny runs of the command built in-process, for the tests of its components: the digits
recipe (a small MLP on scikit-learn's bundled digits), its micro-batch given (no planning),
no TensorBoard files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradaccum.app import Run, TrainConfig, build_run


def quiet(*args: Any, **kwargs: Any) -> None:
    """A log that drops everything."""


def digits_config(out: Path, **options: Any) -> TrainConfig:
    settings = {
        "recipe": "digits",
        "effective_batch": 16,
        "micro_batch": 6,
        "steps": 6,
        "checkpoint_every": 3,
        "eval_every": 3,
        "tensorboard": False,
        "out": str(out),
        **options,
    }
    return TrainConfig.of(**settings)


def digits_run(out: Path, log=quiet, **options: Any) -> Run:
    """A built digits run in ``out`` (its folder locked: ``run.folder.release()`` after)."""
    return build_run(digits_config(out, **options), log=log)
