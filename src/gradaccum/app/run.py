"""A run as built: the state ``build_run(cfg)`` assembles (gradaccum.app.build) and the
trainer's components work on. Nothing here trains, writes or decides a cadence: those are the
components' (gradaccum.app.trainer lists them), each handed the parts of the run it needs.

``Progress`` is where the run is and what it learned on the way (the samples the guard set
aside, its rollbacks, the seconds it trained): with the batch schedule, the state a
checkpoint carries beside the model's. ``Run.state_dict`` and ``Run.restore`` are that
checkpoint's body and its reading, one place for the format every version since 0.3 writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gradaccum.schedule import BatchSchedule

if TYPE_CHECKING:  # types only: the run imports no component
    from gradaccum.app.config import TrainConfig
    from gradaccum.app.folder import RunFolder
    from gradaccum.app.guard import IncidentGuard
    from gradaccum.app.kinds import RunKind
    from gradaccum.app.recipes import Recipe
    from gradaccum.app.targets import Targets

__all__ = ["Progress", "Run"]


@dataclass
class Progress:
    """The run's position and its length: in steps (``total_steps``, from --steps) or in
    samples (``total_samples``, from --samples or --epochs); the schedule holds the position
    in both."""

    schedule: BatchSchedule
    total_steps: int | None
    total_samples: int | None
    start: int = 0  # the step this session began at
    skips: list[list[int]] = field(default_factory=list)  # [first, end) samples set aside
    retries: int = 0  # rollbacks in a row that did not get past the incident's step
    last_incident: int = 0  # the step of the latest incident
    elapsed: float = 0.0  # training seconds over all sessions, as of the last window
    stopped_by: str = "length"

    @property
    def step(self) -> int:
        return self.schedule.step

    @property
    def in_samples(self) -> bool:
        return self.total_samples is not None

    def fraction(self) -> float:
        """The share of the run done, in its own unit."""
        if self.total_samples is not None:
            return self.schedule.samples / self.total_samples
        return self.schedule.step / self.total_steps

    def done(self) -> bool:
        return self.fraction() >= 1

    def next_size(self) -> int:
        """The next window's samples: the schedule's, cut to what the run has left."""
        size = self.schedule.size()
        if self.total_samples is not None:
            size = min(size, self.total_samples - self.schedule.samples)
        return size

    def skip_ahead(self) -> None:
        """A window that would begin at samples the guard set aside begins after them."""
        moved = True
        while moved:
            moved = False
            for first, end in self.skips:
                if first <= self.schedule.samples < end:
                    self.schedule.samples, moved = end, True

    def set_aside(self, spans: list[tuple[int, int]], step: int) -> None:
        """A rollback's samples set aside, counted as one more rollback for ``step``."""
        self.retries += 1
        self.last_incident = step
        for first, end in spans:
            if [first, end] not in self.skips:
                self.skips.append([first, end])
        self.skip_ahead()

    def passed(self, step: int) -> None:
        """A window trained past the latest incident: the next one starts a new count."""
        if step > self.last_incident:
            self.retries = 0

    def length(self) -> str:
        if self.total_samples is not None:
            return f"{self.total_samples:,} samples"
        return f"{self.total_steps} steps"


@dataclass
class Run:
    """Everything built for a run: the configuration, its folder, the kind of run (one
    process, DDP, FSDP2, a pipeline), the model, data, optimizer and window runner, and its
    progress."""

    cfg: TrainConfig
    folder: RunFolder
    kind: RunKind
    recipe: Recipe
    model: torch.nn.Module
    device: torch.device
    data: Any
    optimizer: torch.optim.Optimizer
    acc: Any  # the window runner: an Accumulator, or a pipeline's PipelineWindow
    micro_size: int
    checkpointing: bool
    signature: dict[str, Any]
    progress: Progress
    targets: Targets
    guard: IncidentGuard | None = None
    carried: int = 0  # resident bytes planning and the baseline left for training (Resident)
    eval_micro_size: int | None = None  # the plan's own for evaluation, else micro_size

    @property
    def schedule(self) -> BatchSchedule:
        return self.progress.schedule

    @property
    def eval_size(self) -> int:
        return self.eval_micro_size or self.micro_size

    @property
    def main(self) -> bool:
        return self.kind.main

    def state_dict(self, step: int, accumulator: Any) -> dict[str, Any]:
        """A checkpoint's body at window boundary ``step``, around ``accumulator``: the
        window runner's state as the kind saves it (``RunKind.save_parts``)."""
        p = self.progress
        return {
            "step": step,
            "micro_batch": self.micro_size,  # the stored key keeps its name (old runs resume)
            "sync": self.kind.sync_mode(self.acc),
            "checkpointing": self.checkpointing,
            "signature": self.signature,
            "schedule": p.schedule.state_dict(),
            "accumulator": accumulator,
            "guard": None if self.guard is None else self.guard.state_dict(),
            "skips": p.skips,
            "retries": p.retries,
            "last_incident": p.last_incident,
            "elapsed": p.elapsed,
            "targets": self.targets.observed,
            # what this session trained with, as config.json says it: a resume finds a hand
            # edit of config.json against it
            "config": json.loads(json.dumps(self.cfg.flat(), default=str)),
        }

    def restore(self, saved: dict[str, Any], *, rollback: bool = False) -> None:
        """The state ``state_dict`` saved. A rollback keeps what the run learned since: the
        samples set aside, its count of rollbacks and the time it has trained, and its
        totals of skipped windows and out-of-memory replays (they happened: the summary
        counts them, as the warnings said them)."""
        totals = (self.acc.state.skipped_windows, self.acc.state.oom_replays)
        self.kind.restore(self.acc, self.folder, saved["accumulator"])
        if rollback:
            self.acc.state.skipped_windows, self.acc.state.oom_replays = totals
        p = self.progress
        p.schedule.load_state_dict(saved["schedule"])
        if self.guard is not None and saved.get("guard") is not None:
            self.guard.load_state_dict(saved["guard"])
        self.targets.observed = dict(saved.get("targets", {}))
        if not rollback:
            p.skips = [list(r) for r in saved.get("skips", [])]
            p.retries = int(saved.get("retries", 0))
            p.last_incident = int(saved.get("last_incident", 0))
            p.elapsed = float(saved.get("elapsed", 0.0))
            p.start = p.schedule.step
