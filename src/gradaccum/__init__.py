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
import types as _types

__version__ = "0.7.0"

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
    "gradaccum.plan": "Plan PlanRequest plan",
    "gradaccum.plan.estimate": "Estimate estimate",
    "gradaccum.precision": "Precision",
    "gradaccum.recompute": "disable_checkpointing enable_checkpointing",
    "gradaccum.schedule": "BatchSchedule",
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names.split()}

__all__ = sorted(_WHERE, key=str.lower)


class _Package(_types.ModuleType):
    """This package, whose names load on first use. A submodule that shares a name with what
    it exports (``gradaccum.plan`` and ``ga.plan()``) never takes that name's place: an
    import of the submodule leaves ``gradaccum.plan`` the function, as an eager ``from
    gradaccum.plan import plan`` here would."""

    def __getattr__(self, name: str):
        module = _WHERE.get(name)
        if module is None:
            raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")
        value = getattr(_importlib.import_module(module), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, _types.ModuleType) and name in _WHERE:
            value = getattr(value, name) if _WHERE[name] == value.__name__ else value
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_WHERE})


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _Package
