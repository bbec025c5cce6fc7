"""Estimating a training window's peak memory on a GPU that is not here: the window traced with
fake tensors (``trace``), what CUDA does differently (``cuda``), CUDA's caching allocator
(``allocator``), the GPU families' constants (``devices``), the result (``Estimate``)."""

from gradaccum.planning.estimate.estimator import estimate
from gradaccum.planning.estimate.result import Estimate

__all__ = ["Estimate", "estimate"]
