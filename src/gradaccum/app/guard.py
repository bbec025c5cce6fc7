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

import torch

from gradaccum.app.folder import INCIDENTS
from gradaccum.batching import split, to_device
from gradaccum.checkpoint import preserved_rng

__all__ = ["GUARD_RETRIES", "Incident", "IncidentGuard", "Rollback"]

GUARD_RETRIES = 3  # rollbacks in a row not getting past the incident's step, then a stop

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


class Rollback:
    """The guard's other half: after an incident, back to the newest kept checkpoint from
    before the blamed windows whose state passes the guard itself, their samples set aside,
    the incident recorded in incidents.jsonl. ``recent`` remembers the windows an incident
    can blame. Handed the parts it works with: the checkpoint files and the checkpointer
    (to write the rolled-back state again, now with the samples set aside: a resumed run
    decides alike), ``restore`` (``Run.restore``), the run's progress, and for the probe of
    a restored state the data, model, loss and micro-batch."""

    def __init__(self, guard, store, checkpointer, restore, progress, probe, log) -> None:
        self.guard, self.store, self.checkpointer = guard, store, checkpointer
        self.restore, self.progress, self.probe, self.log = restore, progress, probe, log
        self.recent: list[tuple[int, int, int]] = []  # (step, first, end sample) of windows

    def check(self, step: int, first: int, samples: int, result: Any) -> Incident | None:
        """The window just trained (its first sample and size), judged; None without the
        guard. The loss and gradient norm are global, so every rank judges alike."""
        self.recent = [*self.recent[-20:], (step, first, first + samples)]
        if self.guard is None:
            return None
        return self.guard.check(result.loss, result.grad_norm, result.skipped is not None)

    def roll_back(self, incident: Incident) -> bool:
        """Back before the incident's windows. Returns True when the guard gives up: after
        GUARD_RETRIES rollbacks in a row that did not get past the incident's step, or a
        divergence, the run stops there."""
        blamed, self.recent = self.recent[-incident.windows :], []
        step, p = blamed[-1][0], self.progress
        folder = self.store.folder
        kept = [(s, f) for s, f in self.store.kept() if s < blamed[0][0]]
        if not kept:  # cannot happen while the folder is intact: the run keeps its first state
            raise ValueError(
                f"the incident guard found a {incident.kind} at step {step} but {folder.path} "
                "holds no kept checkpoint to roll back to; resume with --no-guard"
            )
        back, unusable = self._target(kept)  # restored
        gave_up = p.retries >= GUARD_RETRIES or not incident.blames_data
        span = [blamed[0][1], blamed[-1][2]]
        passed = f" ({unusable})" if unusable else ""
        if not incident.blames_data:
            grew = incident.seen["loss"] / incident.seen["first_loss"]
            action = (
                f"stopped: the loss grew {grew:.3g}x over the first window's in the warm-up, "
                "which is the optimization diverging (too high a learning rate?), not bad "
                f"data: nothing set aside; the run is back at step {back}{passed}"
            )
        elif gave_up:
            judged = (
                ", whose state scores its own last window within the guard's band"
                if self.probe.alone
                else ""
            )
            action = (
                f"stopped: {p.retries} rollbacks in a row did not get past it; the run is back "
                f"at step {back}{judged}{passed}"
            )
        else:
            p.set_aside([(first, end) for _, first, end in blamed], step)
            action = (
                f"rolled back to step {back}; samples {span[0]:,} to {span[1]:,} set aside "
                f"(rollback {p.retries} of at most {GUARD_RETRIES} in a row){passed}"
            )
        self.checkpointer.save(back)
        if self.checkpointer.writes:
            seen = {k: round(v, 6) for k, v in incident.seen.items()}
            record = {
                "step": step,
                "samples": span,
                "kind": incident.kind,
                "seen": seen,
                "action": action,
                "rolled_back_to": back,
                "retry": p.retries,
            }
            folder.append_line(INCIDENTS, record)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in incident.seen.items())
        self.log(f"incident at step {step}: {incident.kind} ({shown}); {action}")
        return gave_up

    def _target(self, kept: list[tuple[int, Any]]) -> tuple[int, str]:
        """(step, what was passed over) of the newest kept checkpoint whose state passes the
        guard itself, restored: every weight and optimizer entry finite, and (one process)
        the restored model scoring the window it last trained on within the guard's band. A
        target that fails is a bad state, never called good: an older one is tried; none
        left is a ValueError."""
        passed = []
        for back, file in reversed(kept):
            saved = self.checkpointer.kind.load_saved(self.store.folder, self.probe.device, file)
            if not finite(saved["accumulator"]):
                passed.append(f"step {back} holds non-finite weights")
                continue
            self.restore(saved, rollback=True)
            problem = self.probe(back, self.guard.highest_loss())
            if problem is None:
                return back, "; ".join(passed)
            passed.append(f"step {back} {problem}")
        raise ValueError(
            "the incident guard would roll back, but no kept checkpoint holds a good state ("
            + "; ".join(passed)
            + "): the run went bad before them; start a new run (a lower --lr?)"
        )


class Probe:
    """What is wrong with a state just restored at step ``back``: its loss on the samples of
    step ``back``'s window (which the guard accepted when it trained on them) non-finite or
    above the guard's band, or None. Forward only, nothing of the run changed (buffers and
    random generators are put back). One process only (``alone``): elsewhere every rank
    would have to agree on the shards' sum, and a pipeline's forward is its schedule."""

    def __init__(self, folder, data, model, loss_fn, micro_size: int, device, kind: Any):
        self.folder, self.data, self.model, self.loss_fn = folder, data, model, loss_fn
        self.micro_size, self.device, self.alone = micro_size, device, kind.world == 1

    def __call__(self, back: int, highest: float | None) -> str | None:
        if back == 0 or highest is None or not self.alone:
            return None
        line = next((x for x in reversed(self.folder.metrics()) if x.get("step") == back), None)
        if line is None or not line.get("effective_batch"):
            return None
        size = int(line["effective_batch"])
        batch = self.data.batch(int(line["samples"]) - size, size)
        buffers = {k: v.clone() for k, v in self.model.named_buffers()}
        total = count = 0.0
        with torch.no_grad(), preserved_rng():
            for mb in split(to_device(batch, self.device), self.micro_size):
                loss_sum, n = self.loss_fn(self.model, mb)
                total += float(loss_sum)
                count += float(n)
        for name, value in self.model.named_buffers():
            value.copy_(buffers[name])
        loss = total / max(count, 1.0)
        if not math.isfinite(loss) or loss > highest:
            return f"scores its own last window at loss {loss:.4g}, above the guard's {highest:.4g}"
        return None


def finite(state: Any) -> bool:
    """Whether every floating-point tensor in a (nested) state is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(finite(v) for v in state)
    return True
