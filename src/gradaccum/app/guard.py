"""The incident guard: is this window's loss or gradient far outside the run's recent history?

Large runs that spike roll back to a checkpoint from before the spike and skip the data that
caused it (PaLM and OPT did this by hand). ``IncidentGuard`` makes the first half of that
decision, one window at a time, from robust statistics of the windows it accepted:

- a **loss spike**: the window's loss above ``median + threshold x spread`` of the last
  ``history`` accepted windows' losses, where ``spread`` is the median absolute deviation
  scaled to a standard deviation (x 1.4826), but never below ``floor`` x the loss's own
  scale: the larger of the median and the run's first window (the untrained model's loss,
  chance level for a classifier). A run on a plateau has almost no spread, and a converged
  classifier's median falls toward zero while one hard sample in a small window still
  lifts its mean by a fraction of chance level: neither is an incident, and bad data
  (random labels) scores at chance level or above;
- a **gradient spike**: the same test on the gradient norm before clipping, when
  ``gradient`` is on. The trainer turns it on only without clipping: clipping already bounds
  the step a gradient spike takes, and language models' gradient norms spike on clean data
  (bench/results/guard.md), so with clipping the loss is what tells damage from noise;
- a run of **skipped windows**: ``skipped_windows`` non-finite windows in a row;
- a **divergence**: during the warm-up, a loss ``diverge`` times the first window's. No
  history says what is normal yet, but a loss that grows tenfold from an untrained model's
  is the optimization failing (too high a learning rate), not the data: the trainer sets
  nothing aside and stops.

Only upward departures count (a loss falling fast is training, not an incident); spikes are
judged once ``warmup`` windows were accepted. A window judged an incident does not enter
the history, so one spike cannot widen the band that should catch the next. The trainer does
the rest (roll back, skip the windows' samples, record the incident); the guard's state
travels in its checkpoints, so a resumed run judges exactly as an uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Incident", "IncidentGuard"]

_MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal sample, in sigmas


@dataclass(frozen=True)
class Incident:
    """What the guard saw: ``kind`` is "loss spike", "gradient spike" or "skipped windows";
    ``windows`` how many of the most recent windows are to blame (1 for a spike)."""

    kind: str
    windows: int
    seen: dict[str, float] = field(default_factory=dict)

    @property
    def blames_data(self) -> bool:
        """Whether the windows' samples are to blame (a divergence is the run's own)."""
        return self.kind != "divergence"


@dataclass
class IncidentGuard:
    history: int = 50
    warmup: int = 20
    threshold: float = 6.0
    floor: float = 0.1
    skipped_windows: int = 5
    gradient: bool = True
    diverge: float = 10.0

    def __post_init__(self) -> None:
        for name in ("history", "warmup", "skipped_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("threshold", "floor", "diverge"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.warmup > self.history:
            raise ValueError(f"warmup {self.warmup} exceeds history {self.history}")
        self._losses: deque[float] = deque(maxlen=self.history)
        self._norms: deque[float] = deque(maxlen=self.history)
        self._skipped_run = 0
        self._first: dict[str, float] = {}  # the first judged window's loss and norm

    def band(self, values: deque[float], name: str = "loss") -> tuple[float, float]:
        """(median, the highest value still accepted) of ``name`` ("loss", "grad_norm")."""
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        scale = max(abs(median), self._first.get(name, 0.0))
        spread = max(_MAD_TO_SIGMA * mad, self.floor * scale)
        return median, median + self.threshold * spread

    def highest_loss(self) -> float | None:
        """The highest loss the guard accepts now; None during its warm-up."""
        if len(self._losses) < self.warmup:
            return None
        return self.band(self._losses)[1]

    def check(self, loss: float | None, grad_norm: float | None, skipped: bool) -> Incident | None:
        """Judge one window; an accepted window joins the history. A window that held no item
        (``loss`` None, not skipped) is neither judged nor remembered."""
        if skipped:
            self._skipped_run += 1
            if self._skipped_run >= self.skipped_windows:
                run, self._skipped_run = self._skipped_run, 0
                return Incident("skipped windows", run, {"skipped_in_a_row": float(run)})
            return None
        self._skipped_run = 0
        if loss is None or grad_norm is None:
            return None
        warm = len(self._losses) >= self.warmup
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite and not self._first:
            self._first = {"loss": abs(float(loss)), "grad_norm": abs(float(grad_norm))}
        if not finite:
            # A non-finite loss over a finite gradient (an infinite loss on a masked item):
            # an incident once there is a history to judge by, never part of it.
            return (
                Incident("loss spike", 1, {"loss": loss, "grad_norm": grad_norm}) if warm else None
            )
        first = self._first["loss"]
        if not warm and first > 0 and loss > self.diverge * first:
            return Incident("divergence", 1, {"loss": loss, "first_loss": first})
        if warm:
            judged = [("loss spike", "loss", loss, self._losses)]
            if self.gradient:
                judged.append(("gradient spike", "grad_norm", grad_norm, self._norms))
            for kind, name, value, past in judged:
                median, highest = self.band(past, name)
                if value > highest:
                    seen = {name: value, f"{name}_median": median, f"{name}_threshold": highest}
                    return Incident(kind, 1, seen)
        self._losses.append(float(loss))
        self._norms.append(float(grad_norm))
        return None

    def margins(self, loss: float, grad_norm: float) -> dict[str, float] | None:
        """How close a window would come to an alarm: (value - median) / (threshold - median)
        for its loss and gradient norm, 1.0 at the threshold; None during the warm-up."""
        if len(self._losses) < self.warmup:
            return None
        out = {}
        for name, value, past in (
            ("loss", loss, self._losses),
            ("grad_norm", grad_norm, self._norms),
        ):
            median, highest = self.band(past, name)
            out[name] = (value - median) / (highest - median) if highest > median else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "norms": list(self._norms),
            "skipped_run": self._skipped_run,
            "first": dict(self._first),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.history)
        self._norms = deque((float(x) for x in state["norms"]), maxlen=self.history)
        self._skipped_run = int(state["skipped_run"])
        # (a guard of gradaccum 0.6 or before kept no first window: its oldest remembered
        # one stands in, the closest to the run's start it has)
        first = state.get("first")
        if first is None and self._losses:
            first = {"loss": abs(self._losses[0]), "grad_norm": abs(self._norms[0])}
        self._first = {k: float(v) for k, v in (first or {}).items()}
