"""Where a step's numbers go: a list of sinks behind one small interface (``Sink``):
metrics.jsonl, TensorBoard's event files, the terminal (the progress bar, else a log line
with the time left), and any a caller adds (``Trainer(run, sinks=[...])``); at the end
memory.json. Every one of them is built from the one metrics table (report/metrics.py).
Rank 0 writes; elsewhere nothing is written."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gradaccum.app.folder import MEMORY, METRICS, RunFolder
from gradaccum.app.report.metrics import STEP
from gradaccum.memory import format_bytes

__all__ = ["Console", "MetricsFile", "MetricsSink", "Sink", "TensorBoard", "Written", "duration"]
__all__ += ["step_line"]


def step_line(values: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics line: the table's metrics that ``values`` holds, in its order."""
    return {m.name: values[m.name] for m in STEP if m.name in values}


@dataclasses.dataclass(frozen=True)
class Written:
    """What a sink gets beside a step's line: ``totals``, the window runner's counters
    (TensorBoard's); ``rate``, items a second; ``before``, the share of the run done before
    this step."""

    totals: Any
    rate: float
    before: float


class Sink(Protocol):
    """One place a step's line goes: ``open(start)`` before the first window, ``write(line,
    at)`` after each, ``restart(step)`` after a rollback, ``close()`` at the end. A write
    that cannot be made raises ValueError with the line the run stops on."""

    def open(self, start: int) -> None: ...

    def write(self, line: dict[str, Any], at: Written) -> None: ...

    def restart(self, step: int) -> None: ...

    def close(self) -> None: ...


class MetricsSink:
    """The run's sinks, in order: metrics.jsonl (``MetricsFile``), TensorBoard's event files
    where asked for (``TensorBoard``), the terminal (``Console``), then any given
    (``sinks``); and at the end memory.json. ``open(start)`` before the first window,
    ``write(line, ...)`` after each, ``restart`` after a rollback, ``close(memory, carried)``
    at the end. ``stopped`` words a write that failed (the checkpointer's: what is kept, how
    to go on). Rank 0 writes; elsewhere nothing is written."""

    def __init__(
        self,
        folder: RunFolder,
        progress: Any,
        item: str,
        log,
        *,
        writes: bool,
        tensorboard: bool,
        max_grad_norm: float | None,
        stopped: Callable[[str], str],
        clock: Callable[[], float] = time.perf_counter,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.folder, self.log, self.writes = folder, log, writes
        self.tensorboard, self.max_grad_norm, self.stopped = tensorboard, max_grad_norm, stopped
        self.console = Console(progress, item, log, clock)
        self.sinks: list[Sink] = [MetricsFile(folder, stopped), self.console, *sinks]

    def open_events(self, start: int) -> None:
        """TensorBoard's writer, when asked for and installed. Before the memory meter
        starts: importing TensorBoard raises the process's resident memory, and that is not
        training."""
        from gradaccum.app.report import events

        if not (self.writes and self.tensorboard):
            return
        if not events.available():
            self.log(
                "TensorBoard: the tensorboard package is not installed, so no event files "
                "(pip install 'gradaccum[tensorboard]'); metrics.jsonl has every number"
            )
            return
        log = events.EventLog(self.folder.path, start, self.max_grad_norm)
        self.sinks.insert(1, TensorBoard(log, self.stopped))

    def open(self, start: int) -> None:
        if self.writes:
            for sink in self.sinks:
                sink.open(start)

    def write(self, line: dict[str, Any], totals: Any, rate: float, before: float) -> None:
        """A step's line everywhere it goes (``Written``: what goes with it)."""
        if self.writes:
            at = Written(totals, rate, before)
            for sink in self.sinks:
                sink.write(line, at)

    def restart(self, step: int) -> None:
        """After a rollback to ``step``: every sink from there."""
        if self.writes:
            for sink in self.sinks:
                sink.restart(step)

    def close(self, memory: Any, carried: int) -> None:
        """The sinks closed; memory.json: what each part of this session peaked at, for the
        plan's prediction to be judged by (bench/planner.py)."""
        if not self.writes:
            return
        for sink in self.sinks:
            sink.close()
        if memory.phases:
            with contextlib.suppress(OSError, ValueError):
                record = {"peak": memory.peak(), "phases": memory.phases, "carried": carried}
                self.folder.write_json(MEMORY, record)


class MetricsFile:
    """metrics.jsonl: one JSON line a step, cut back to the step a run resumes or rolls
    back to."""

    def __init__(self, folder: RunFolder, stopped: Callable[[str], str]) -> None:
        self.folder, self.stopped, self.file = folder, stopped, None

    def open(self, start: int) -> None:
        self.file = self.folder.open_metrics(start)

    def write(self, line: dict[str, Any], at: Written) -> None:
        try:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        except OSError as err:
            what = f"cannot write {self.folder.path / METRICS}: {err.strerror or err}"
            with contextlib.suppress(OSError):  # what is still buffered would fail again
                self.file.close()
            raise ValueError(self.stopped(what)) from None

    def restart(self, step: int) -> None:
        self.file.close()
        self.file = self.folder.open_metrics(step)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # (a write that failed is already said)
                self.file.close()


class TensorBoard:
    """TensorBoard's event files (``report/events.py``), opened before the memory meter
    starts (``MetricsSink.open_events``)."""

    def __init__(self, events: Any, stopped: Callable[[str], str]) -> None:
        self.events, self.stopped = events, stopped

    def open(self, start: int) -> None:
        pass  # opened at ``start`` when made

    def write(self, line: dict[str, Any], at: Written) -> None:
        try:
            self.events.write(line, at.totals)
        except ValueError as err:
            raise ValueError(self.stopped(str(err))) from None

    def restart(self, step: int) -> None:
        self.events.restart(step)

    def close(self) -> None:
        self.events.close()


class Console:
    """The terminal: the progress bar's postfix on a terminal, else a log line after the
    first window, then whenever the next window would end more than ``_EVERY`` seconds after
    the last line, at each tenth of the run, at its end and at each evaluation; with the
    time left once a few windows have run (``time_left``, held by ``shown_left``)."""

    def __init__(self, progress: Any, item: str, log, clock: Callable[[], float]) -> None:
        self.progress, self.item, self.log = progress, item, log
        self.bar: Any = None
        # (seconds, steps or samples) of this session's recent windows, the first (warm-up)
        # left out: what the time left is measured from
        self.recent: deque[tuple[float, int]] = deque(maxlen=_ETA_WINDOWS)
        self.windows = 0
        # The seconds between step lines that are not their windows' (the evaluations, the
        # checkpoints, the exports), the steps or samples they came with, and those up to
        # the last such pause longer than its window, since open() or a rollback: what
        # each step still to come adds to the windows' pace, in the proportion the run has
        # paid it over whole periods of its evaluations (steps after the last one have not
        # paid theirs yet).
        self.clock = clock
        self.last: float | None = None
        self.outside = [0.0, 0, 0]
        # the last log line's time and the time left it said (None: none said yet)
        self.said_at: float | None = None
        self.said_left: float | None = None

    def open(self, start: int) -> None:
        self.bar = _progress_bar(self.progress)
        self.last, self.outside = self.clock(), [0.0, 0, 0]

    def restart(self, step: int) -> None:
        self.last, self.outside = self.clock(), [0.0, 0, 0]  # the rollback's own time left out
        if self.bar is not None:
            p = self.progress
            self.bar.n = p.schedule.samples if p.in_samples else p.schedule.step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def write(self, line: dict[str, Any], at: Written) -> None:
        rate, before = at.rate, at.before
        loss = "skipped" if line["loss"] is None else f"{line['loss']:.3f}"
        item = self.item
        text = (
            f"loss {loss} nats/{item}  {rate:,.0f} {item}s/s  "
            f"mem {format_bytes(line['peak_memory'])}"
        ) + (f"  held-out {line['eval_loss']:.3f}" if "eval_loss" in line else "")
        # The recipe's other held-out measures (accuracy, IoU), by their names.
        text += "".join(
            f" {k[5:]} {v:.3f}"
            for k, v in line.items()
            if k.startswith("eval_") and k != "eval_loss"
        )
        p = self.progress
        self.windows += 1
        units = line["effective_batch"] if p.in_samples else 1
        now, seconds = self.clock(), line.get("seconds")
        if seconds is not None:
            if self.windows > 1:
                self.recent.append((seconds, units))
            if self.last is not None:
                pause = max(0.0, now - self.last - seconds)
                self.outside[0] += pause
                self.outside[1] += units
                if pause > seconds:  # an evaluation, a checkpoint: a period of them ends
                    self.outside[2] = self.outside[1]
        self.last = now
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(units)
            return
        done, clock = p.fraction(), now
        due = self.said_at is None or clock - self.said_at + (seconds or 0.0) > _EVERY
        if due or int(done * 10) > int(before * 10) or done >= 1 or "eval_loss" in line:
            where = (
                f"{line['step']:>5}  {line['samples']:>7,}/{p.total_samples:,} samples"
                if p.in_samples
                else f"{line['step']:>5}/{p.total_steps}"
            )
            left = self.shown_left(line, clock)
            eta = f"  ETA {duration(left)}" if left is not None and left >= 1 else ""
            self.log(f"step {where}  {text}{eta}")
            self.said_at = clock

    def shown_left(self, line: dict[str, Any], clock: float) -> float | None:
        """The time left a log line says: ``time_left``, moved at most ``_SWING`` times
        from what the line before said (less the time since) once ``_STEADY`` windows have
        run. A load that comes and goes moves the windows' pace by more than that between
        two lines; the said time follows it over a few lines instead of jumping (it read
        14m59s, 23m13s, 5m17s)."""
        left = self.time_left(line)
        if left is not None and self.said_left is not None and self.windows > _STEADY:
            then = max(self.said_left - (clock - (self.said_at or clock)), 0.0)
            if then > 0:
                left = min(max(left, then / _SWING), then * _SWING)
        self.said_left = left
        return left

    def time_left(self, line: dict[str, Any]) -> float | None:
        """The run's time left at the pace of its recent windows (their measured seconds per
        step, or per sample for a run measured in samples), plus what the run has spent per
        step outside its windows so far (evaluations, checkpoints, exports: a run that
        evaluates every 2 steps pays for its evaluations in the steps still to come too);
        None until a few windows have run. The windows' pace now, not the session's
        average: on a machine whose load changes, an average over the start lags behind
        (it began at 7m29s and kept rising)."""
        if len(self.recent) < _ETA_AFTER:
            return None
        p = self.progress
        pace = sum(s for s, _ in self.recent) / sum(n for _, n in self.recent)
        pace += self.outside[0] / max(self.outside[2] or self.outside[1], 1)
        left = p.total_samples - line["samples"] if p.in_samples else p.total_steps - line["step"]
        return max(left, 0) * pace


_ETA_AFTER = 3  # windows measured (after the first) before the time left is said
_ETA_WINDOWS = 10  # the recent windows it is measured over
_EVERY = 10.0  # seconds: the longest a run goes without a log line (windows permitting)
_STEADY = 10  # windows before the time left said is held to _SWING per line
_SWING = 2.0  # the most the time left said moves between two lines


def _progress_bar(progress: Any):
    from tqdm import tqdm  # imported here: only a terminal needs it

    if not sys.stderr.isatty():
        return None
    # A terminal that reports no size (some ptys, `script`, containers) gives tqdm no rows,
    # and with none it draws nothing at all: give it the usual 100 x 20 then.
    size = shutil.get_terminal_size((100, 20))
    columns, rows = (size.columns or 100), (size.lines if size.lines > 1 else 20)
    if progress.in_samples:
        total, done, unit = progress.total_samples, progress.schedule.samples, "sample"
    else:
        total, done, unit = progress.total_steps, progress.schedule.step, "step"
    return tqdm(total=total, initial=done, unit=unit, ncols=columns, nrows=rows)


def duration(seconds: float) -> str:
    """45s, 3m05s, 1h02m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
