"""gradaccum: exact gradient accumulation for PyTorch.

Train with the batch size your recipe needs on the memory you have, and get exactly the
gradient that the large batch would have given. See README.md for the tour.
"""

from gradaccum.batching import batch_size, shard, split, windows
from gradaccum.diagnose import batchnorm_momentum, check, convert_batchnorm
from gradaccum.engine import Accumulator, AccumulatorState, StepResult
from gradaccum.loss import causal_lm_loss, sample_mean, token_cross_entropy
from gradaccum.memory import (
    disable_checkpointing,
    enable_checkpointing,
    format_bytes,
    inject_oom,
    parse_bytes,
)
from gradaccum.plan import Plan, plan

__all__ = [
    "Accumulator",
    "AccumulatorState",
    "StepResult",
    "batch_size",
    "Plan",
    "batchnorm_momentum",
    "check",
    "convert_batchnorm",
    "causal_lm_loss",
    "disable_checkpointing",
    "enable_checkpointing",
    "format_bytes",
    "inject_oom",
    "parse_bytes",
    "plan",
    "sample_mean",
    "shard",
    "split",
    "token_cross_entropy",
    "windows",
]

__version__ = "0.1.0"
