"""Schedules of the effective batch, in whole micro-batches.

A window is any whole number of micro-batches, so the effective batch may change from one
window to the next and every window is still exact; the micro-batch size stays the planned
one, so memory stays planned. A ``BatchSchedule`` tells the loop how many samples the next
window takes, and learns from what the window did:

    schedule = ga.BatchSchedule("linear:9600=256", start=32, unit=micro_size)
    while schedule.samples < total:
        size = schedule.size()                      # samples in the next window
        batch = data[schedule.samples : schedule.samples + size]
        result = acc.step(ga.split(batch, micro_size), loss_fn)
        schedule.update(result, size)

Its data position counts samples, not steps (``schedule.samples``), so a resumed run reads
exactly what an uninterrupted one would whatever the schedule did; ``state_dict()`` travels
with checkpoints.

Kinds (the start is always ``start``, the first windows' effective batch):

- ``constant``: ``start`` throughout.
- ``steps:S1=B1,S2=B2,...``: from optimizer step S1 on, B1 samples per step; from S2, B2...
- ``samples:N1=B1,N2=B2,...``: the same, at N1, N2... samples seen.
- ``linear:N=B``: from ``start`` to B in a straight line over the first N samples.
- ``auto``: from ``start``, raised toward the gradient noise scale B_simple (McCandlish et al.
  2018), only when its whole interval lies above the current batch (``NoiseScale``'s
  ``confidence``, 90% by default), at most ``growth`` times per change and never above
  ``maximum``. It never lowers the batch: B_simple grows as training goes on.

Every batch but ``start`` is rounded to whole multiples of ``unit`` (the micro-batch size,
times the number of processes under data parallelism).

``lr_factor`` is the learning-rate rule that goes with a changing batch: ``none``,
``linear`` (Goyal et al. 2017, for SGD) or ``sqrt`` (Malladi et al. 2022 derive it for Adam;
the default of ``gradaccum train``, which trains with AdamW).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "LR_RULES", "BatchSchedule", "lr_factor"]

KINDS = ("constant", "steps", "samples", "linear", "auto")
LR_RULES = ("none", "linear", "sqrt")


def lr_factor(rule: str, batch: int, start: int) -> float:
    """The learning rate's multiplier at effective batch ``batch`` when ``start`` is the
    batch the base learning rate was tuned for."""
    if rule == "none":
        return 1.0
    if rule == "linear":
        return batch / start
    if rule == "sqrt":
        return math.sqrt(batch / start)
    raise ValueError(f"lr rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


@dataclass
class BatchSchedule:
    """The effective batch of each window (samples), and the data position.

    ``spec``: the kind, as in the module's docstring (``"constant"``, ``"steps:50=128"``,
    ``"samples:3200=128,9600=256"``, ``"linear:9600=256"``, ``"auto"``); ``start``: the
    first windows' batch; ``unit``: later batches are whole multiples of it; ``maximum``:
    auto's ceiling (default 8 x ``start``); ``growth``: auto's largest factor per change.
    """

    spec: str = "constant"
    start: int = 1
    unit: int = 1
    maximum: int | None = None
    growth: float = 2.0
    kind: str = field(init=False)
    points: list[tuple[int, int]] = field(init=False)
    # the position and auto's state, in state_dict()
    step: int = field(default=0, init=False)
    samples: int = field(default=0, init=False)
    items: int = field(default=0, init=False)
    current: int = field(init=False)
    changes: list[tuple[int, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        problems = schedule_problems(self.spec, self.start, self.unit, self.maximum)
        if not (isinstance(self.growth, (int, float)) and self.growth > 1):
            problems.append(f"growth must be a number > 1, got {self.growth!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.kind, self.points = _parse(self.spec)
        if self.maximum is None:
            self.maximum = 8 * self.start
        self.current = self.start

    def whole(self, batch: float) -> int:
        """``batch`` rounded to whole multiples of ``unit`` (at least one)."""
        return max(self.unit, round(batch / self.unit) * self.unit)

    def size(self) -> int:
        """Samples in the next window."""
        if self.kind in ("constant", "auto"):
            return self.current
        if self.kind == "linear":
            ((span, target),) = self.points
            if self.samples >= span:
                return self.whole(target)
            batch = self.start + (target - self.start) * self.samples / span
            return self.start if batch == self.start else self.whole(batch)
        now = self.step if self.kind == "steps" else self.samples
        batch = self.start
        for when, value in self.points:
            if now >= when:
                batch = self.whole(value)
        return batch

    def update(self, result: Any, samples: int) -> None:
        """After a window of ``samples`` samples that returned ``result`` (a ``StepResult``:
        its ``count`` of items and, with a NoiseScale, ``noise_interval``)."""
        self.step += 1
        self.samples += samples
        self.items += result.count
        if self.kind != "auto" or result.noise_interval is None or self.samples == 0:
            return
        per_sample = self.items / self.samples  # B_simple is in items (tokens); batches in samples
        low = result.noise_interval[0] / per_sample
        if low <= self.current:
            return
        batch = min(self.maximum, self.current * self.growth, low)
        batch = min(self.maximum, max(self.unit, math.floor(batch / self.unit) * self.unit))
        if batch > self.current:
            self.current = batch
            self.changes.append((self.step, batch))

    def describe(self) -> str:
        """The schedule in words, with its batches rounded as they will run."""
        if self.kind == "constant":
            return f"constant effective batch {self.start}"
        if self.kind == "auto":
            return (
                f"auto: from {self.start}, raised toward B_simple when its interval lies above, "
                f"at most x{self.growth:g} per change, up to {self.maximum}"
            )
        if self.kind == "linear":
            ((span, target),) = self.points
            return f"linear ramp from {self.start} to {self.whole(target)} over {span:,} samples"
        unit = "step" if self.kind == "steps" else "samples seen"
        steps = ", ".join(f"{self.whole(b)} from {unit} {w:,}" for w, b in self.points)
        return f"{self.start} at first, then {steps}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "step": self.step,
            "samples": self.samples,
            "items": self.items,
            "current": self.current,
            "changes": [list(c) for c in self.changes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["spec"] != self.spec:
            raise ValueError(
                f"checkpoint was written under batch schedule {state['spec']!r}, not {self.spec!r}"
            )
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.items, self.current = int(state["items"]), int(state["current"])
        self.changes = [(int(s), int(b)) for s, b in state["changes"]]


def _parse(spec: str) -> tuple[str, list[tuple[int, int]]]:
    """``(kind, [(when, batch), ...])``; ValueError with what was expected."""
    if not isinstance(spec, str):
        raise ValueError(f"batch schedule must be a string, got {spec!r}")
    kind, _, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(
            f"batch schedule {spec!r}: expected constant, auto, steps:S=B,..., "
            "samples:N=B,... or linear:N=B"
        )
    if kind in ("constant", "auto"):
        if rest:
            raise ValueError(f"batch schedule {spec!r}: {kind} takes no points")
        return kind, []
    points = []
    for part in rest.split(","):
        when, eq, batch = part.strip().partition("=")
        try:
            point = (int(when.replace("_", "")), int(batch.replace("_", "")))
        except ValueError:
            point = None
        if not eq or point is None or point[0] < 0 or point[1] < 1:
            raise ValueError(
                f"batch schedule {spec!r}: {part.strip()!r} is not WHEN=BATCH with whole "
                "numbers (WHEN >= 0, BATCH >= 1)"
            )
        points.append(point)
    if kind == "linear" and (len(points) != 1 or points[0][0] < 1):
        raise ValueError(f"batch schedule {spec!r}: linear takes one N=B with N >= 1 samples")
    whens = [w for w, _ in points]
    if whens != sorted(set(whens)):
        raise ValueError(f"batch schedule {spec!r}: the points must be in increasing order")
    return kind, points


def schedule_problems(spec: Any, start: Any, unit: Any, maximum: Any) -> list[str]:
    """Every problem with a schedule's arguments, for a configuration's problem list."""
    out = []
    for name, value in (("start", start), ("unit", unit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(f"{name} must be an integer >= 1, got {value!r}")
    if maximum is not None and (
        isinstance(maximum, bool) or not isinstance(maximum, int) or maximum < 1
    ):
        out.append(f"max_effective_batch must be an integer >= 1, got {maximum!r}")
    elif maximum is not None and isinstance(start, int) and maximum < start:
        out.append(f"max_effective_batch {maximum} is below the starting effective batch {start}")
    try:
        _parse(spec)
    except ValueError as err:
        out.append(str(err))
    return out
