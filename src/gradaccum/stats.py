"""Small statistics the library needs without scipy: a least-squares line (the memory model
and the noise scale both fit one), Student's t quantile, and Fieller's interval for a ratio
of two means."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

__all__ = ["fieller", "fit_line", "t_quantile"]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through the points; needs at least
    two distinct x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("a line needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - slope * mx, slope


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile at probability ``p`` (0.5 < p < 1) with ``dof`` >= 2 degrees of
    freedom: the Cornish-Fisher expansion around the normal quantile (Abramowitz & Stegun
    26.7.5): for p <= 0.95, within 0.3% of the exact value at 2 degrees of freedom and
    within 0.01% from 5 on (wider intervals at 2 degrees of freedom: a 99% quantile is 4%
    low there)."""
    if dof < 2:
        raise ValueError(f"t_quantile needs at least 2 degrees of freedom, got {dof}")
    z = NormalDist().inv_cdf(p)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / dof ** (i + 1) for i, term in enumerate(terms))


def fieller(
    num: float, den: float, v_num: float, v_den: float, cov: float, q: float
) -> tuple[float, float] | None:
    """Fieller's interval for ``num / den``, two means with variances ``v_num``, ``v_den``
    and covariance ``cov``, at critical value ``q``: the ratios R with
    (num - R den)^2 <= q^2 var(num - R den). It is a bounded interval exactly when ``den``
    is clearly away from zero (den^2 > q^2 v_den, with den > 0); otherwise None."""
    a = den * den - q * q * v_den
    if den <= 0 or a <= 0:
        return None
    b = num * den - q * q * cov
    c = num * num - q * q * v_num
    root = math.sqrt(max(b * b - a * c, 0.0))  # >= 0 whenever the covariance is one
    return (b - root) / a, (b + root) / a
