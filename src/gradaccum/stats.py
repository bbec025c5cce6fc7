"""A straight line by least squares: the memory model and the noise scale both fit one."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fit_line"]


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
