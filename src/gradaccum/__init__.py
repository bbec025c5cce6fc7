"""gradaccum: exact gradient accumulation for PyTorch.

Train with the batch size your recipe needs on the memory you have, and get exactly the
gradient that the large batch would have given. See README.md for the tour and docs/ for
the guides.

The public API is re-exported here (``ga.Accumulator``, ``ga.split``, ...). Each name loads
with its module on first use, so that ``import gradaccum`` alone costs nothing and the
``gradaccum`` command can install its Ctrl-C handling (gradaccum.app.process) before torch
loads.
"""

import importlib as _importlib

__version__ = "0.8.0"

# what each module exports, by name
_EXPORTS = {
    "gradaccum.batching": "shard split windows",
    "gradaccum.diagnose": "audit batchnorm_momentum check convert_batchnorm",
    "gradaccum.engine": "Accumulator AccumulatorState StepResult",
    "gradaccum.inbatch": "InBatch",
    "gradaccum.loss": "causal_lm_loss constant_normalizer group_count per_group per_sequence "
    "per_token sample_mean sequence_count sequence_ids token_count token_cross_entropy",
    "gradaccum.noise": "NoiseReading NoiseScale",
    "gradaccum.oom": "OOMReplay",
    "gradaccum.planning": "Plan PlanRequest plan",
    "gradaccum.planning.estimate": "Estimate estimate",
    "gradaccum.precision": "Precision",
    "gradaccum.recompute": "disable_checkpointing enable_checkpointing",
    "gradaccum.schedule": "BatchSchedule",
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names.split()}

__all__ = sorted(_WHERE, key=str.lower)


def __getattr__(name: str):
    """A public name, loaded with its module on first use (PEP 562) and kept."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
