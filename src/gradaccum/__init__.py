"""gradaccum: exact gradient accumulation for PyTorch.

Train with the batch size your recipe needs on the memory you have, and get exactly the
gradient that the large batch would have given. See README.md for the tour and docs/ for
the guides.
"""

import sys as _sys


def _is_the_command() -> bool:
    argv = getattr(_sys, "orig_argv", [])
    return _sys.argv[0].rsplit("/", 1)[-1] == "gradaccum" or argv[1:3] == ["-m", "gradaccum"]


def _stop_while_loading(signum, frame) -> None:
    """The command's Ctrl-C while modules load (torch takes seconds): one line and exit 130,
    as for every other stop. Not a KeyboardInterrupt: torch's C side imports numpy and drops
    whatever that import raises, leaving numpy half made (the next import of it fails, or
    sklearn's recurses until it dies), and one raised inside a C++ initialiser aborts the
    process. Nothing is written yet, so leaving at once loses nothing."""
    import os

    print("gradaccum: interrupted", file=_sys.stderr, flush=True)
    os._exit(130)


def _watch_the_commands_loading() -> None:
    """For the `gradaccum` command only; a program that imports the library keeps its own
    handler. It stays while gradaccum.app loads too; the command's main() takes over."""
    import signal

    if _is_the_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _stop_while_loading)
        except ValueError:  # not the main thread
            pass


_watch_the_commands_loading()

from gradaccum.batching import shard, split, windows  # noqa: E402
from gradaccum.diagnose import audit, batchnorm_momentum, check, convert_batchnorm  # noqa: E402
from gradaccum.engine import Accumulator, AccumulatorState, StepResult  # noqa: E402
from gradaccum.inbatch import InBatch  # noqa: E402
from gradaccum.loss import (  # noqa: E402
    causal_lm_loss,
    constant_normalizer,
    group_count,
    per_group,
    per_sequence,
    per_token,
    sample_mean,
    sequence_count,
    sequence_ids,
    token_count,
    token_cross_entropy,
)
from gradaccum.noise import NoiseReading, NoiseScale  # noqa: E402
from gradaccum.oom import OOMReplay  # noqa: E402
from gradaccum.plan import Plan, plan  # noqa: E402
from gradaccum.precision import Precision  # noqa: E402
from gradaccum.recompute import disable_checkpointing, enable_checkpointing  # noqa: E402
from gradaccum.schedule import BatchSchedule  # noqa: E402

__all__ = [
    "Accumulator",
    "AccumulatorState",
    "audit",
    "BatchSchedule",
    "InBatch",
    "NoiseReading",
    "NoiseScale",
    "OOMReplay",
    "Plan",
    "Precision",
    "StepResult",
    "batchnorm_momentum",
    "causal_lm_loss",
    "check",
    "constant_normalizer",
    "convert_batchnorm",
    "disable_checkpointing",
    "enable_checkpointing",
    "group_count",
    "per_group",
    "per_sequence",
    "per_token",
    "plan",
    "sample_mean",
    "sequence_count",
    "sequence_ids",
    "shard",
    "split",
    "token_count",
    "token_cross_entropy",
    "windows",
]

__version__ = "0.7.0"
