"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), read off the window for free.

Each micro-batch's gradient and the window's gradient are the mean gradient at two batch
sizes, B_small (the micro-batch's count) and B_big (the window's count). With G the true
gradient and Sigma the per-item gradient covariance,

    E|G_B|^2 = |G|^2 + tr(Sigma) / B,

so two sizes give unbiased estimates of both:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

The small batches are the window's prefixes: after micro-batch i, the gradient summed so
far is the sum over the first B_i items, a mean gradient at batch size B_i. Its squared
norm is one fused reduction over ``.grad`` (or the fp32 buffers): no extra backward, no
copy, no hook. A least-squares line through (1/B_i, |G_{B_i}|^2) over the window's prefixes
gives both estimates (intercept |G|^2, slope tr(Sigma)); they are smoothed separately with a
bias-corrected EMA, and B_simple = tr(Sigma) / |G|^2 is the batch size above which larger
batches give diminishing returns.

Under DDP or FSDP2 (``sync="window"``) the prefixes are this rank's micro-batches before
the reduction, and the window's reduced gradient adds one point at the global batch size:
B_big is the whole global batch. Each rank fits its own prefixes and the shared global
point; rank 0's estimate is the one reported.

(Per-parameter gradient hooks can read each micro-batch's own gradient as it arrives, at
the price of a Python call per parameter per micro-batch. Prefix sums give the same
unbiased estimates with one fused norm per micro-batch; bench/noise.py measures the cost.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradaccum.stats import fit_line
from gradaccum.window import total_norm

__all__ = ["NoiseScale", "advice"]


@dataclass
class NoiseScale:
    """The estimator and its state: ``Accumulator(..., noise=NoiseScale(ema=0.95))``.

    ``ema``: smoothing of the estimates, per window. One instance per Accumulator; its state
    travels with the Accumulator's checkpoints."""

    ema: float = 0.95
    g2: float = 0.0  # EMA of |G|^2 (uncorrected)
    trace: float = 0.0  # EMA of tr(Sigma) (uncorrected)
    updates: int = 0
    _prefixes: list[tuple[torch.Tensor, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        ok = isinstance(self.ema, (int, float)) and not isinstance(self.ema, bool)
        if not ok or not 0 <= self.ema < 1:
            raise ValueError(f"ema must be a number in [0, 1), got {self.ema!r}")
        self.ema = float(self.ema)

    def record(self, sums: list[torch.Tensor], count: Any, multiplier: float = 1.0) -> None:
        """After a micro-batch: the window's gradient summed so far (``sums``, carrying the
        loss ``multiplier`` of fp16 scaling) and that micro-batch's own item count (int or
        0-dim tensor; the prefix counts are summed at the window's end, with one host sync).
        A micro-batch of no items (a padding replay) leaves the prefix as it was."""
        self.add_prefix(total_norm(sums).square() / multiplier**2, count)

    def add_prefix(self, sq_norm: torch.Tensor, count: Any) -> None:
        """``record`` with the prefix's squared norm already taken (a framework integration
        takes it after each backward and adds it once it knows the backward stayed local)."""
        if isinstance(count, int) and count == 0:
            return
        self._prefixes.append((sq_norm, count))

    def end_window(
        self, window_sq_norm: float | None, total: int, window_point: bool = False
    ) -> float | None:
        """Fold one window into the estimates; returns B_simple or None while undefined.

        ``window_point``: add the window's mean gradient (squared norm ``window_sq_norm`` over
        ``total`` items) as a point of its own. Data-parallel training does: its prefixes are
        this rank's micro-batches before the reduction, and the window is the global batch.
        Alone, the last prefix already is the window.
        """
        prefixes, self._prefixes = self._prefixes, []
        if window_sq_norm is None or total <= 0:
            return self.value()
        points = []
        if prefixes:
            device = prefixes[0][0].device
            stacked = torch.stack(
                [
                    torch.stack([s.to(device).double(), torch.as_tensor(c, device=device).double()])
                    for s, c in prefixes
                ]
            ).cpu()
            sq = stacked[:, 0].tolist()
            counts = stacked[:, 1].cumsum(0).tolist()  # items in each prefix
            # E|G_B|^2 = |G|^2 + tr(Sigma) / B is a line in 1/B: fit it by least squares
            # through every prefix (the whole window included). Each prefix alone gives an
            # unbiased pair too, but the long prefixes sit close to the window and their
            # differences are noise.
            points = [(1 / c, s / (c * c)) for s, c in zip(sq, counts, strict=True) if c > 0]
        if window_point:
            points.append((1 / total, window_sq_norm))
        if len({x for x, _ in points}) < 2:
            return self.value()
        g2, trace = fit_line([x for x, _ in points], [y for _, y in points])
        self.updates += 1
        self.g2 = self.ema * self.g2 + (1 - self.ema) * g2
        self.trace = self.ema * self.trace + (1 - self.ema) * trace
        return self.value()

    def drop_window(self) -> None:
        self._prefixes = []

    def estimates(self) -> tuple[float, float] | None:
        """Bias-corrected (|G|^2, tr(Sigma)), or None before the first update."""
        if self.updates == 0:
            return None
        correction = 1 - self.ema**self.updates
        return self.g2 / correction, self.trace / correction

    def value(self) -> float | None:
        est = self.estimates()
        if est is None or est[0] <= 0:
            return None
        return est[1] / est[0]

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "g2": self.g2, "trace": self.trace, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema, self.g2 = float(state["ema"]), float(state["g2"])
        self.trace, self.updates = float(state["trace"]), int(state["updates"])


def advice(effective_batch: int, b_simple: float | None, estimated: bool = False) -> str:
    """Plain words on the effective batch against the estimated critical batch.

    ``estimated``: windows were folded in (``NoiseScale.updates > 0``), so a missing
    ``b_simple`` means the |G|^2 estimate is not positive rather than no data yet."""
    if b_simple is None and estimated:
        return (
            "gradient noise scale: undefined so far: the estimated |G|^2 is not positive, "
            "i.e. the true gradient is small against its noise (near convergence, or a "
            "batch far below the critical one)"
        )
    if b_simple is None:
        return "gradient noise scale: not estimated yet (needs windows of 2+ micro-batches)"
    ratio = effective_batch / b_simple
    head = f"gradient noise scale B_simple ~ {b_simple:,.0f} items per step"
    if ratio > 2:
        return (
            f"{head}; your effective batch ({effective_batch:,}) is {ratio:.0f}x the "
            "estimated critical batch: smaller batches would need fewer samples per unit "
            "of progress"
        )
    if ratio < 0.5:
        return (
            f"{head}; your effective batch ({effective_batch:,}) is {1 / ratio:.0f}x below "
            "it: larger batches would make nearly linear progress per step (fewer, "
            "better-parallelized steps)"
        )
    return f"{head}; your effective batch ({effective_batch:,}) is near it: a good trade"
