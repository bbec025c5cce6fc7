"""A run's targets: stop when a quality target is met or a cost limit is reached.

Quality targets are judged on the held-out evaluation, so they are checked at each
evaluation (``--eval-every`` sets how often): ``target_loss`` is met when the held-out loss
is at or below it, ``target_accuracy`` when the held-out accuracy is at or above it. Cost
limits are checked after every window: ``max_time`` against the training time of all the
run's sessions together, ``max_memory`` against the peak training memory. ``Targets.summary``
says for each whether it was met (or reached), missed (or stayed within) or not set, with the
number observed and when.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["QUALITY", "TargetWatch", "Targets", "parse_seconds"]

QUALITY = {"target_loss": ("eval_loss", -1), "target_accuracy": ("eval_accuracy", 1)}
_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}


def parse_seconds(text: str | float | int) -> float:
    """A duration: a number of seconds, or a number with s, m (min) or h."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*(s|m|min|h)?\s*", str(text))
        if match is None:
            raise ValueError(f"expected seconds or a duration such as 90s, 15m, 2h, got {text!r}")
        value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a positive duration, got {text!r}")
    return value


@dataclass
class Targets:
    target_loss: float | None = None
    target_accuracy: float | None = None
    max_time: float | None = None  # seconds
    max_memory: int | None = None  # bytes
    # per target: what was observed last, and when a target was met or a limit reached
    observed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def limit_reached(self, elapsed: float, peak_memory: int) -> bool:
        """Whether a cost limit is reached (the run then evaluates once more before it stops)."""
        return (self.max_time is not None and elapsed >= self.max_time) or (
            self.max_memory is not None and peak_memory >= self.max_memory
        )

    def already(self, elapsed: float) -> str | None:
        """At a resume, before any window: a limit the run has already reached, or a quality
        target its last evaluation already met (the limits may have changed since)."""
        if self.max_time is not None and elapsed >= self.max_time:
            self.observed["max_time"] = {**self.observed.get("max_time", {}), "value": elapsed}
            return "max_time"
        for name, (_, sign) in QUALITY.items():
            limit, seen = getattr(self, name), self.observed.get(name, {})
            if limit is not None and seen.get("value") is not None:
                if sign * seen["value"] >= sign * limit:
                    return name
        return None

    def check(self, line: dict[str, Any], elapsed: float) -> str | None:
        """After a window (its metrics line, the run's training seconds so far): the name of
        the first target met or limit reached, or None to go on."""
        when = {"step": line["step"], "samples": line.get("samples"), "seconds": elapsed}
        hit = None
        for name, (key, sign) in QUALITY.items():
            limit = getattr(self, name)
            if limit is None or key not in line:
                continue
            value = line[key]
            self.observed[name] = {"value": value}
            if sign * value >= sign * limit:
                self.observed[name] = {"value": value, **when}
                hit = hit or name
        for name, value in (("max_time", elapsed), ("max_memory", line["peak_memory"])):
            limit = getattr(self, name)
            if limit is None:
                continue
            self.observed[name] = {"value": value}
            if value >= limit:
                self.observed[name] = {"value": value, **when}
                hit = hit or name
        return hit

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name in (*QUALITY, "max_time", "max_memory"):
            limit = getattr(self, name)
            seen = self.observed.get(name, {})
            if limit is None:
                status = "not set"
            elif "step" in seen:
                status = "met" if name in QUALITY else "reached"
            else:
                status = "missed" if name in QUALITY else "within"
            out[name] = {
                "limit": limit,
                "status": status,
                "value": seen.get("value"),
                "step": seen.get("step"),
                "samples": seen.get("samples"),
                "seconds": seen.get("seconds"),
            }
        return out

    def describe(self) -> str:
        """One line for the log: what is set."""
        parts = []
        if self.target_loss is not None:
            parts.append(f"held-out loss <= {self.target_loss:g}")
        if self.target_accuracy is not None:
            parts.append(f"held-out accuracy >= {self.target_accuracy:g}")
        if self.max_time is not None:
            parts.append(f"at most {self.max_time:g} s of training")
        if self.max_memory is not None:
            from gradaccum.memory import format_bytes

            parts.append(f"peak memory under {format_bytes(self.max_memory)}")
        return "; ".join(parts)

    def said(self, name: str) -> str:
        """What met target ``name`` (or reached the limit), in words."""
        from gradaccum.memory import format_bytes

        seen = self.observed[name]["value"]
        if name == "target_loss":
            return f"held-out loss {seen:.4f} <= target {self.target_loss:g}"
        if name == "target_accuracy":
            return f"held-out accuracy {seen:.4f} >= target {self.target_accuracy:g}"
        if name == "max_time":
            return f"{seen:.1f} s of training reached --max-time ({self.max_time:g} s)"
        return (
            f"peak memory {format_bytes(seen)} reached --max-memory "
            f"({format_bytes(self.max_memory or 0)})"
        )


class TargetWatch:
    """The targets judged after each window by the process that ``judges`` (rank 0, whose
    evaluation the metrics line holds); its verdict stops every rank."""

    def __init__(self, targets: Targets, *, judges: bool) -> None:
        self.targets, self.judges = targets, judges

    def check(self, line: dict[str, Any], elapsed: float) -> str | None:
        from gradaccum.app import launch

        hit = self.targets.check(line, elapsed) if self.judges else None
        return launch.broadcast(hit)
