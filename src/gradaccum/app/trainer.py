"""The main job: train a recipe with an exact large batch, plan its memory, keep a run folder.

``train(cfg)`` is ``Trainer(build_run(cfg)).fit()``: the run built (app/build.py: the folder,
model, data, optimizer, micro-batch and window runner, in a ``Run``), then trained window by
window. The loop calls components, each owning its cadence and doing nothing on a process
that does not write:

    lr.py              the learning rate of each window
    stops.py           stop signals, and their agreement between ranks
    guard.py           the incident guard and its rollback
    boundary.py        the record each component is handed at a window's end, and their contract
    evaluation.py      the held-out evaluation
    report/sink.py     metrics.jsonl, TensorBoard, the progress bar and the log line
    checkpoints.py     when to checkpoint, and the checkpoint files
    exporter.py        the exports and the whole model gathered from shards
    targets.py         targets met and limits reached
    report/summary.py  the end: summary.json, plots, report.html, the summary table

The loop never asks which rank it is or which kind of run it is (app/kinds.py answers for
the kind; the components know whether they write).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from gradaccum.app import launch
from gradaccum.app.boundary import Boundary, Component
from gradaccum.app.build import build_run
from gradaccum.app.checkpoints import Checkpointer, Checkpoints
from gradaccum.app.config import TrainConfig, invalid_configuration
from gradaccum.app.evaluation import Evaluator
from gradaccum.app.exporter import Exporter
from gradaccum.app.folder import THIRD_PARTY
from gradaccum.app.guard import Probe, Rollback
from gradaccum.app.lr import LearningRate
from gradaccum.app.process import THIRD_PARTIES, Output, quiet
from gradaccum.app.report.sink import MetricsSink, Sink, step_line
from gradaccum.app.report.summary import report
from gradaccum.app.run import Run
from gradaccum.app.stops import Interrupted, StopSignals
from gradaccum.app.targets import TargetWatch
from gradaccum.batching import batch_size, largest_share, to_device
from gradaccum.memory import TrainingMemory

__all__ = ["Trainer", "train"]


def train(cfg: TrainConfig, *, log=print) -> dict[str, Any]:
    """Run (or resume) a training run; returns the summary. Raises ``Interrupted`` after
    checkpointing on SIGINT/SIGTERM/SIGHUP or a closed output pipe, ValueError on bad
    configuration or an unusable run folder (one line each). Under torchrun every process
    runs it; rank 0 alone plans, writes the run folder and reports (the others return
    ``{"rank": N}``). The effective batch is global: each rank trains its shard of it."""
    problems = cfg.problems()
    if problems:
        raise ValueError(invalid_configuration(problems))
    stops = StopSignals()
    rank, world = launch.init_from_env()
    log = Output(log, stops.requested) if rank == 0 else quiet
    return Trainer(build_run(cfg, rank, world, log), log, stops).fit()


class Trainer:
    """A built run trained to its end: ``fit()``. The components are made here from the
    parts of the run each one needs."""

    def __init__(
        self,
        run: Run,
        log=print,
        stops: StopSignals | None = None,
        components: Sequence[Component] = (),
        sinks: Sequence[Sink] = (),
    ) -> None:
        cfg, p = run.cfg, run.progress
        self.run, self.log, self.stops = run, log, stops or StopSignals()
        store = Checkpoints(run.folder)
        keep = cfg.incidents.keep_checkpoints if run.guard is not None else None
        self.checkpointer = Checkpointer(
            store, run.kind, run.acc, run.state_dict,
            every=cfg.output.checkpoint_every, keep=keep, start=p.start,
        )  # fmt: skip
        stopped = self.checkpointer.stopped
        every = cfg.output.eval_every
        self.evaluator = Evaluator(
            run.kind, run.data, run.model, run.eval_size, every,
            stopped=lambda: bool(self.stops.requested),
        )  # fmt: skip
        self.exporter = Exporter(cfg, run.folder, run.model, run.kind, log, stopped)
        # what runs after each step's line, in this order (``boundary.Component``)
        self.components = [self.checkpointer, self.exporter, *components]
        self.sink = MetricsSink(
            run.folder, p, run.recipe.item, log, writes=run.main,
            tensorboard=cfg.output.tensorboard, max_grad_norm=cfg.numerics.max_grad_norm or None,
            stopped=stopped, sinks=sinks,
        )  # fmt: skip
        probe = Probe(
            run.folder, run.data, run.model, run.recipe.loss_fn, run.micro_size, run.device,
            run.kind,
        )  # fmt: skip
        self.rollback = Rollback(run.guard, store, self.checkpointer, run.restore, p, probe, log)
        self.lr = LearningRate(cfg.schedule, cfg.batch.effective_batch, p)
        self.targets = TargetWatch(run.targets, judges=run.main)
        self.memory: TrainingMemory | None = None
        self.began, self.items = 0.0, 0
        # the folder holds the run (config.json) by now: a file more in it refuses nothing
        self.third_party = run.folder.path / THIRD_PARTY if run.main else None

    def fit(self) -> dict[str, Any]:
        """Train from the run's position to its length, a target, a stop or the guard's
        verdict; then the report. A start that fails before its first step leaves nothing
        behind (``RunFolder.abandon``); the folder's lock is released in every case. What
        other packages said that the command kept off the terminal, from the start of the
        process to the run's end, goes to the folder's third_party.log."""
        run = self.run
        THIRD_PARTIES.into(self.third_party)
        try:
            began, interrupted = time.perf_counter(), None
            try:
                why = self.loop()
            except Interrupted as stop:
                why, interrupted = "signal", stop
            run.progress.stopped_by = why  # why the run stopped: set here alone
            # On a stop signal the report describes this session, not the last one that
            # ended; the table is not printed (the stop message says what to do).
            summary = self.report(time.perf_counter() - began, table=interrupted is None)
            if interrupted is not None:
                raise interrupted
            return summary
        except BaseException:
            THIRD_PARTIES.close()  # before abandon may clear the folder: nothing written after
            run.folder.abandon()  # only a run that trained no step is removed
            raise
        finally:
            THIRD_PARTIES.close()
            run.folder.release()

    def loop(self) -> str:
        """Window by window from the run's position, inside the stop signals' watch; why it
        stopped: "length", a target or limit reached (already, on a resume), or "guard"
        (``Progress.stopped_by``'s words). A stop signal raises ``Interrupted``."""
        run, p = self.run, self.run.progress
        self.announce()
        with self.stops:
            reached = run.targets.already(p.elapsed) if p.start else None
            if reached is not None:  # a resume of a run at its limit or target: no more
                self.log(
                    f"{run.folder.path} is already stopped: {run.targets.said(reached)}; "
                    "change that option on --resume to train on"
                )
                return reached
            self.sink.open_events(p.start)
            # rank 0's reading, taken before any rank writes
            if run.kind.agree(run.guard is not None and not run.folder.kept_checkpoints()):
                self.checkpointer.save(p.start)  # something to roll back to from the start
            self.memory = TrainingMemory(run.model, run.device, carried=run.carried)
            self.sink.open(p.start)
            self.evaluator.owed = self.evaluation_owed()
            self.began, self.items, before = time.perf_counter(), 0, p.elapsed
            why = None
            try:
                while why is None and not p.done():
                    why = self.window(before)
            finally:
                self.sink.close(self.memory, run.carried)
            return why or "length"

    def window(self, before: float) -> str | None:
        """One window and what follows it (its line, evaluation, checkpoint, exports); why
        the run stops here ("guard", a target or limit), None where it goes on. ``before``:
        training seconds of earlier sessions."""
        run, p, memory = self.run, self.run.progress, self.memory
        t0, size, done_before = time.perf_counter(), p.next_size(), p.fraction()
        lr = self.lr.apply(run.optimizer, size)
        first = p.schedule.samples
        batch = run.data.batch(first, size)
        samples = batch_size(batch)  # fewer than size at the end of an epoch
        batch = to_device(run.kind.local(batch), run.device)
        with memory.phase("training"):
            result = run.kind.step(run.acc, batch, run.micro_size, run.recipe.loss_fn)
        step = self.advance(result, samples)
        p.elapsed = before + time.perf_counter() - self.began
        incident = self.rollback.check(step, first, samples, result)
        if incident is not None:
            gave_up = self.rollback.roll_back(incident)
            self.sink.restart(p.step)
            return "guard" if gave_up else None
        p.skip_ahead()
        p.passed(step)
        self.items += result.count
        line = self.line(result, step, samples, lr, time.perf_counter() - t0)
        memory.window_done()
        at = Boundary(step, p.done(), run.targets.limit_reached(p.elapsed, memory.peak()))
        if self.evaluator.due(at):
            with memory.phase("evaluation"):
                line.update({f"eval_{k}": v for k, v in self.evaluator.evaluate().items()})
        line["peak_memory"] = memory.peak()  # the run's: windows, evaluations, checkpoints
        at.hit = self.targets.check(line, p.elapsed)
        rate = self.items / max(time.perf_counter() - self.began, 1e-9)
        self.sink.write(line, run.acc.state, rate, done_before)
        at.stopping = self.stops.agreed()
        for component in self.components:
            if component.due(at):
                with memory.phase(component.phase):
                    component.run(at)
        if at.stopping:
            raise self.stops.interrupted(step, run.folder.path, getattr(self.log, "failure", None))
        if at.hit:
            self.log(f"stopping at step {step}: {run.targets.said(at.hit)}")
        return at.hit

    def evaluation_owed(self) -> bool:
        """Whether the resumed run's first window evaluates: the session before it stopped
        on a signal without its held-out numbers (its evaluation abandoned, or none at the
        stop), so the resume gives them at once. Rank 0's reading, on every rank."""
        run = self.run
        owed = False
        if run.main and run.progress.start > 0:
            lines = run.folder.metrics()
            last = lines[-1] if lines else {}
            owed = bool(last) and not any(k.startswith("eval_") for k in last)
        return bool(run.kind.agree(owed))

    def advance(self, result: Any, samples: int) -> int:
        """The schedule moved past the window just trained; its step."""
        schedule = self.run.progress.schedule
        schedule.update(result, samples)
        if schedule.kind == "auto":
            # Each rank reads the noise off its own prefixes: rank 0's decision holds.
            schedule.current = launch.main_int(schedule.current)
        return schedule.step

    def line(self, result: Any, step: int, samples: int, lr: float, seconds: float) -> dict:
        """The window's metrics line (held-out numbers and the peak join it later)."""
        low, high = result.noise_interval or (None, None)
        p = self.run.progress
        return step_line(
            {
                "step": step, "samples": p.schedule.samples, "effective_batch": samples,
                "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                "count": result.count, "micro_batches": result.micro_batches,
                "seconds": seconds, "skipped": result.skipped,
                "oom_replays": result.oom_replays, "noise_scale": result.noise_scale,
                "noise_low": low, "noise_high": high,
            }
        )  # fmt: skip

    def announce(self) -> None:
        """The run's first lines: its length and batch, and its targets."""
        run, cfg, kind = self.run, self.run.cfg, self.run.kind
        effective, schedule = cfg.batch.effective_batch, run.progress.schedule
        per_rank = largest_share(effective, kind.replicas)
        per_window = math.ceil(per_rank / run.micro_size)
        plural = "es" if per_window > 1 else ""
        shape = f"{per_window} micro-batch{plural} of up to {run.micro_size}"
        if per_window == 1 and schedule.kind == "constant":  # said, not left to arithmetic
            shape = f"1 micro-batch of {per_rank} (no accumulation)"
        self.log(
            f"training {run.progress.length()}: effective batch {effective} = {shape}"
            f"{kind.across(cfg)}"
            + ("" if schedule.kind == "constant" else f"; schedule: {schedule.describe()}")
            + f"; {run.data.epoch_samples():,} samples per epoch; run folder {run.folder.path}"
        )
        if run.targets.describe():
            self.log(f"targets: {run.targets.describe()}")

    def report(self, seconds: float, table: bool = True) -> dict[str, Any]:
        """The held-out numbers at the last step, then the summary, plots and report (rank
        0; the other ranks take part in a collective evaluation and return their rank)."""
        run = self.run
        lines = run.folder.metrics() if run.main else []  # read once, for both
        signal = run.progress.stopped_by == "signal"  # the resume evaluates, not the stop
        last_eval = self.evaluator.final(lines[-1] if lines else None, signal=signal) or {}
        if not run.main:
            return {"rank": run.kind.rank}
        return report(run, self.log, seconds, lines, last_eval, table=table)
