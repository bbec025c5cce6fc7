"""gradaccum: exact gradient accumulation for PyTorch.

Train with the batch size your recipe needs on the memory you have, and get exactly the
gradient that the large batch would have given. See README.md for the tour and docs/ for
the guides.
"""

import sys as _sys


def _stop_if_the_command() -> None:
    """After a Ctrl-C while modules load (torch takes seconds): the `gradaccum` command says
    so in one line and exits 130, as it does for every other stop; a program that imports
    the library gets its KeyboardInterrupt (the caller re-raises it)."""
    argv = getattr(_sys, "orig_argv", [])
    if _sys.argv[0].rsplit("/", 1)[-1] == "gradaccum" or argv[1:3] == ["-m", "gradaccum"]:
        import os

        print("gradaccum: interrupted", file=_sys.stderr, flush=True)
        # Not SystemExit: under `python -m`, CPython can still end the process by SIGINT
        # after a KeyboardInterrupt, whatever the status asked for. Nothing is written yet.
        os._exit(130)


try:
    from gradaccum.batching import shard, split, windows
    from gradaccum.diagnose import batchnorm_momentum, check, convert_batchnorm
    from gradaccum.engine import Accumulator, AccumulatorState, StepResult
    from gradaccum.loss import causal_lm_loss, sample_mean, token_cross_entropy
    from gradaccum.noise import NoiseReading, NoiseScale
    from gradaccum.oom import OOMReplay
    from gradaccum.plan import Plan, plan
    from gradaccum.precision import Precision
    from gradaccum.recompute import disable_checkpointing, enable_checkpointing
    from gradaccum.schedule import BatchSchedule
except KeyboardInterrupt:
    _stop_if_the_command()
    raise

__all__ = [
    "Accumulator",
    "AccumulatorState",
    "BatchSchedule",
    "NoiseReading",
    "NoiseScale",
    "OOMReplay",
    "Plan",
    "Precision",
    "StepResult",
    "batchnorm_momentum",
    "causal_lm_loss",
    "check",
    "convert_batchnorm",
    "disable_checkpointing",
    "enable_checkpointing",
    "plan",
    "sample_mean",
    "shard",
    "split",
    "token_cross_entropy",
    "windows",
]

__version__ = "0.7.0"
