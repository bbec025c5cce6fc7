"""Moved to gradaccum.plan.exports (0.7): ``gradaccum.export``'s names answer from there
until gradaccum 0.8, each with a DeprecationWarning."""

from typing import Any


def __getattr__(name: str) -> Any:
    from gradaccum.plan import exports

    if name.startswith("__") or not hasattr(exports, name):
        raise AttributeError(f"module 'gradaccum.export' has no attribute {name!r}")
    import warnings

    warnings.warn(
        f"gradaccum.export.{name} moved to gradaccum.plan.exports.{name}; the old name goes "
        "in gradaccum 0.8",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(exports, name)
