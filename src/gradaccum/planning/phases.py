"""The run's other parts (evaluation, a checkpoint, an export), each measured after the
planned window, at a micro-batch of its own when the window's does not fit."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gradaccum.memory import MemoryMeter, format_bytes
from gradaccum.planning.prober import Measured
from gradaccum.planning.result import Phase

__all__ = ["measure_phases"]


def measure_phases(
    phases: Mapping[str, Callable[[int], Any]],
    memory: MemoryMeter,
    m: Measured,
    micro_size: int,
    usable: float,
    budget: int,
    margin: float,
) -> tuple[Phase, ...]:
    """Each of the run's other parts, measured after the planned window; one over the usable
    budget is measured again at half the micro-batch until it fits."""
    out = []
    for name, run in phases.items():
        size, tried = micro_size, []
        while True:
            memory.start()
            try:
                run(size)
            finally:
                memory.stop()
            peak = int(m.base + memory.peak())
            if peak <= usable:
                break
            tried.append((size, peak))
            # a phase whose need did not fall with its micro-batch does not depend on it (a
            # checkpoint, a merge): no smaller size would fit either
            flat = len(tried) > 1 and peak >= 0.97 * tried[-2][1]
            if size == 1 or flat:
                at = "whatever the micro-batch" if flat else "at micro-batch 1"
                raise ValueError(
                    f"budget {format_bytes(budget)} is too small for the run's {name}: {at} "
                    f"it needs a measured {format_bytes(peak)}, above the "
                    f"{format_bytes(usable)} usable after the {margin:.0%} margin; give at "
                    f"least {format_bytes(peak / (1 - margin))}"
                )
            size = math.ceil(size / 2)
        out.append(Phase(name, size, peak, tuple(tried)))
    return tuple(out)
