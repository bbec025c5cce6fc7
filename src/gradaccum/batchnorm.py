"""BatchNorm under accumulation: find it, replace it, or correct its running statistics.

In train mode BatchNorm normalizes each micro-batch with that micro-batch's own mean and
variance, so N micro-batches of m are not one batch of N x m: the forward itself differs,
and no normalization of the gradient can repair it (pytorch issue 46516).

- ``convert_batchnorm(model, to=...)``: "groupnorm" (GroupNorm with up to 32 groups),
  "layernorm" (GroupNorm with 1 group: per-sample statistics over channels and space), or
  "frozen" (always the running statistics, as in eval mode; affine parameters still train).
  Per-sample normalization makes the accumulated step exact again.
- ``batchnorm_momentum(model, micro_batches)``: when you keep BatchNorm, its running
  statistics are updated once per micro-batch, N times a window. With momentum
  m' = 1 - (1 - m)^(1/N), N updates move the running mean and variance, in expectation, as
  far as one update with momentum m from the full batch would:
  (1 - m')^N = 1 - m, and each micro-batch's mean and (unbiased) variance estimate the
  same population values as the full batch's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from gradaccum.validate import positive_int

__all__ = [
    "FrozenBatchNorm",
    "batchnorm_modules",
    "batchnorm_momentum",
    "convert_batchnorm",
    "warn_batchnorm",
]

log = logging.getLogger("gradaccum")

_BN = (nn.modules.batchnorm._BatchNorm,)


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """BatchNorm and SyncBatchNorm layers (any dimension) of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BN)]


def warn_batchnorm(model: nn.Module) -> None:
    """Log a warning naming the BatchNorm layers in train mode, if any: under accumulation
    they change the model, not just its batch size. The Accumulator calls this once."""
    training = [name for name, m in batchnorm_modules(model) if m.training]
    if training:
        log.warning(
            "%s in train mode: each micro-batch is normalized with its own statistics, "
            "so accumulation changes the model (not just its batch size). "
            "gradaccum.diagnose.convert_batchnorm(model) restores exactness; "
            "gradaccum.check() measures the difference",
            ", ".join(training[:3]) + (" ..." if len(training) > 3 else ""),
        )


class FrozenBatchNorm(nn.Module):
    """BatchNorm that always uses its running statistics; weight and bias still train."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.eps = bn.eps
        self.weight = bn.weight
        self.bias = bn.bias
        self.register_buffer("running_mean", bn.running_mean.detach().clone())
        self.register_buffer("running_var", bn.running_var.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = (self.running_var + self.eps).rsqrt()
        out = (x - self.running_mean.view(shape)) * scale.view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def _replacement(bn: nn.Module, to: str) -> nn.Module:
    channels = bn.num_features
    if to == "frozen":
        if bn.running_mean is None:
            raise ValueError(f"{bn} tracks no running statistics; it cannot be frozen")
        return FrozenBatchNorm(bn)
    groups = 1 if to == "layernorm" else math.gcd(32, channels)
    new = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine)
    if bn.affine:
        new.weight = bn.weight  # the same Parameter objects: an optimizer built already
        new.bias = bn.bias  # keeps training them
    device = next((t.device for t in (bn.weight, bn.running_mean) if t is not None), None)
    return new.to(device) if device is not None else new


def convert_batchnorm(model: nn.Module, to: str = "groupnorm") -> list[str]:
    """Replace every BatchNorm/SyncBatchNorm in ``model`` in place; returns their names."""
    if to not in ("groupnorm", "layernorm", "frozen"):
        raise ValueError(f"to must be 'groupnorm', 'layernorm' or 'frozen', got {to!r}")
    names = []
    for name, bn in batchnorm_modules(model):
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            parent = getattr(parent, part)
        setattr(parent, leaf, _replacement(bn, to))
        names.append(name)
    return names


@contextlib.contextmanager
def batchnorm_momentum(model: nn.Module, micro_batches: int) -> Iterator[list[str]]:
    """Within the block, every BatchNorm with a momentum uses m' = 1 - (1 - m)^(1/N), so a
    window of N micro-batches updates its running statistics, in expectation, like one
    full-batch update. Restores the original momenta afterwards."""
    positive_int(micro_batches, "micro_batches")
    saved = []
    for name, bn in batchnorm_modules(model):
        if bn.momentum is not None:  # None: a cumulative average, already order-free
            saved.append((name, bn, bn.momentum))
            bn.momentum = 1 - (1 - bn.momentum) ** (1 / micro_batches)
    try:
        yield [name for name, _, _ in saved]
    finally:
        for _, bn, momentum in saved:
            bn.momentum = momentum
