"""Faults on demand, for tests of code that must survive them. Not used in training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.batching import batch_size

__all__ = ["inject_oom"]


def inject_oom(loss_fn: Callable[..., Any], max_fitting_size: int) -> Callable[..., Any]:
    """``loss_fn`` on a device that holds ``max_fitting_size`` samples: a micro-batch larger
    than that raises ``torch.OutOfMemoryError`` before its forward, as such a device would."""
    if isinstance(max_fitting_size, bool) or not isinstance(max_fitting_size, int):
        raise ValueError(f"max_fitting_size must be an integer, got {max_fitting_size!r}")

    def wrapped(model: torch.nn.Module, micro_batch: Any) -> Any:
        size = batch_size(micro_batch)
        if size > max_fitting_size:
            raise torch.OutOfMemoryError(
                f"injected: micro-batch of {size} exceeds {max_fitting_size}"
            )
        return loss_fn(model, micro_batch)

    return wrapped
