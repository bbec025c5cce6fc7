"""The run's loop: window by window from its position, with its metrics lines, checkpoints,
targets, the incident guard's rollbacks, and stops on signals."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch
from gradaccum.app.config import TrainConfig
from gradaccum.app.exports import write_exports
from gradaccum.app.folder import INCIDENTS, MEMORY, METRICS, MODEL, RunFolder
from gradaccum.app.guard import Incident, IncidentGuard
from gradaccum.app.kinds import RunKind
from gradaccum.app.recipes import Recipe
from gradaccum.app.targets import Targets
from gradaccum.batching import batch_size, to_device
from gradaccum.engine import Accumulator
from gradaccum.memory import TrainingMemory, format_bytes
from gradaccum.pipeline import PipelineWindow
from gradaccum.schedule import BatchSchedule, lr_factor


class Interrupted(Exception):  # noqa: N818 - it is a stop, not an error
    """Training stopped on a signal (SIGINT, SIGTERM, SIGHUP) or a closed output pipe, after
    checkpointing at a window boundary."""

    def __init__(self, step: int, out: Path, signum: int, failure: str | None = None) -> None:
        why = "its output pipe closing" if signum == signal.SIGPIPE else signal.Signals(signum).name
        if failure is not None:  # stdout on a full disk, /dev/full, a dead terminal
            why = f"its output failing ({failure})"
        super().__init__(
            f"stopped by {why} at step {step}; checkpoint saved; "
            f"continue with: gradaccum train --resume {out}"
        )
        self.step, self.out, self.signum = step, out, signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GUARD_RETRIES = 3  # rollbacks in a row not getting past the incident's step, then a stop


class _Output:
    """The log, surviving a closed pipe (``gradaccum train | head``) or output that cannot be
    written (stdout on a full disk): the first write that fails stops training at the next
    window boundary, as SIGPIPE would, and later writes go nowhere."""

    def __init__(self, log, stop: list[int]) -> None:
        self.log, self.stop, self.closed = log, stop, False
        self.failure: str | None = None  # why the output failed, when it was not a pipe

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.closed:
            return
        try:
            self.log(*args, **kwargs)
            sys.stdout.flush()
        except OSError as err:
            self.closed = True
            if not isinstance(err, BrokenPipeError):
                self.failure = err.strerror or str(err)
            # Point stdout at /dev/null so the interpreter's own flush at exit cannot fail too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.stop.append(signal.SIGPIPE)


def _progress(run: _Run):
    from tqdm import tqdm  # imported here: only a terminal needs it

    if not sys.stderr.isatty():
        return None
    # A terminal that reports no size (some ptys, `script`, containers) gives tqdm no rows,
    # and with none it draws nothing at all: give it the usual 100 x 20 then.
    size = shutil.get_terminal_size((100, 20))
    columns, rows = (size.columns or 100), (size.lines if size.lines > 1 else 20)
    if run.total_samples is not None:
        total, done, unit = run.total_samples, run.schedule.samples, "sample"
    else:
        total, done, unit = run.total_steps, run.schedule.step, "step"
    return tqdm(total=total, initial=done, unit=unit, ncols=columns, nrows=rows)


@dataclass
class _Run:
    """Everything built for a run, for the loop and the report. Its length is in steps
    (``total_steps``, from --steps) or in samples (``total_samples``, from --samples or
    --epochs); the schedule holds the position in both."""

    cfg: TrainConfig
    folder: RunFolder
    kind: RunKind  # one process or DDP, FSDP2, a pipeline: what the loop asks of each
    recipe: Recipe
    model: torch.nn.Module
    device: torch.device
    data: Any
    optimizer: torch.optim.Optimizer
    acc: Accumulator | PipelineWindow
    micro_batch: int
    checkpointing: bool
    signature: dict[str, Any]
    schedule: BatchSchedule
    start: int  # the step this session began at
    total_steps: int | None
    total_samples: int | None
    targets: Targets = field(default_factory=Targets)
    guard: IncidentGuard | None = None
    skips: list[list[int]] = field(default_factory=list)  # [first, end) samples set aside
    retries: int = 0  # rollbacks in a row that did not get past the incident's step
    last_incident: int = 0  # the step of the latest incident
    carried: int = 0  # resident bytes planning and the baseline left for training (Resident)
    elapsed: float = 0.0  # training seconds over all sessions, as of the last window
    stopped_by: str = "length"
    eval_micro_batch: int | None = None  # the plan's own for evaluation, else micro_batch

    @property
    def eval_size(self) -> int:
        return self.eval_micro_batch or self.micro_batch

    @property
    def main(self) -> bool:
        return self.kind.main

    def progress(self) -> float:
        """The share of the run done, in its own unit."""
        if self.total_samples is not None:
            return self.schedule.samples / self.total_samples
        return self.schedule.step / self.total_steps

    def done(self) -> bool:
        return self.progress() >= 1

    def restore(self, saved: dict[str, Any], *, rollback: bool = False) -> None:
        """The state ``_checkpoint`` saved. A rollback keeps what the run learned since: the
        samples set aside, its count of rollbacks and the time it has trained, and its
        totals of skipped windows and out-of-memory replays (they happened: the summary
        counts them, as the warnings said them)."""
        totals = (self.acc.state.skipped_windows, self.acc.state.oom_replays)
        self.kind.restore(self.acc, self.folder, saved["accumulator"])
        if rollback:
            self.acc.state.skipped_windows, self.acc.state.oom_replays = totals
        self.schedule.load_state_dict(saved["schedule"])
        if self.guard is not None and saved.get("guard") is not None:
            self.guard.load_state_dict(saved["guard"])
        self.targets.observed = dict(saved.get("targets", {}))
        if not rollback:
            self.skips = [list(r) for r in saved.get("skips", [])]
            self.retries = int(saved.get("retries", 0))
            self.last_incident = int(saved.get("last_incident", 0))
            self.elapsed = float(saved.get("elapsed", 0.0))
            self.start = self.schedule.step

    def skip_ahead(self) -> None:
        """A window that would begin at samples the guard set aside begins after them."""
        moved = True
        while moved:
            moved = False
            for first, end in self.skips:
                if first <= self.schedule.samples < end:
                    self.schedule.samples, moved = end, True

    def next_size(self) -> int:
        """The next window's samples: the schedule's, cut to what the run has left."""
        size = self.schedule.size()
        if self.total_samples is not None:
            size = min(size, self.total_samples - self.schedule.samples)
        return size

    def lr(self, size: int) -> float:
        """The learning rate of the next window, a pure function of the position and the
        window's batch: linear warm-up over --warmup-steps windows, then cosine decay to 10%
        of --lr over the rest of the run, times the batch rule (--lr-scaling)."""
        cfg, step = self.cfg, self.schedule.step
        if step < cfg.schedule.warmup_steps:
            shape = (step + 1) / (cfg.schedule.warmup_steps + 1)
        else:
            if self.total_samples is not None:
                warm = cfg.schedule.warmup_steps * cfg.batch.effective_batch
                done = self.schedule.samples
                total = self.total_samples
            else:
                done, warm, total = step, cfg.schedule.warmup_steps, self.total_steps
            progress = (done - warm) / max(1, total - warm)
            shape = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
        rule, start = cfg.schedule.lr_scaling, cfg.batch.effective_batch
        return cfg.schedule.lr * shape * lr_factor(rule, size, start)

    def length(self) -> str:
        if self.total_samples is not None:
            return f"{self.total_samples:,} samples"
        return f"{self.total_steps} steps"


def _loop(run: _Run, log, stop: list[int], faults=None) -> None:
    """Window by window from the run's position: a metrics line per step, a checkpoint every
    checkpoint_every steps, at the end, and at the boundary after a stop was asked for or a
    target was met; with the guard, a rollback after each incident."""
    cfg, folder, schedule = run.cfg, run.folder, run.schedule
    kind = run.kind
    per_window = math.ceil(math.ceil(cfg.batch.effective_batch / kind.replicas) / run.micro_batch)
    log(
        f"training {run.length()}: effective batch {cfg.batch.effective_batch} = {per_window} "
        f"micro-batch{'es' if per_window > 1 else ''} of up to {run.micro_batch}{kind.across(cfg)}"
        + ("" if schedule.kind == "constant" else f"; schedule: {schedule.describe()}")
        + f"; {run.data.epoch_samples():,} samples per epoch; run folder {folder.path}"
    )
    if run.targets.describe():
        log(f"targets: {run.targets.describe()}")
    # A signal the run was started ignoring (nohup's SIGHUP, a shell's background SIGINT)
    # stays ignored: whoever started the run asked for that.
    caught = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, _: stop.append(signum)) for s in caught}
    reached = run.targets.already(run.elapsed) if run.start else None
    if reached is not None:  # a resume of a run at its limit or target trains nothing more
        run.stopped_by = reached
        log(
            f"{folder.path} is already stopped: {_hit_text(run.targets, reached)}; change "
            "that option on --resume to train on"
        )
        return
    # Before the memory meter starts: importing TensorBoard and writing step 0's checkpoint
    # raise the process's resident memory, and neither is training.
    events = _events(run, log)
    # rank 0's reading, taken before any rank writes
    first_kept = kind.agree(run.guard is not None and not folder.kept_checkpoints())
    if first_kept:
        _checkpoint(run, run.start, run.start)  # something to roll back to from the start
    memory = TrainingMemory(run.model, run.device, carried=run.carried)
    bar = _progress(run) if run.main else None
    metrics = folder.open_metrics(run.start) if run.main else open(os.devnull, "w")
    began, items, last = time.perf_counter(), 0, run.start
    before = run.elapsed  # training seconds of earlier sessions
    # (step, first sample, end sample) of the latest windows: what an incident blames
    recent: list[tuple[int, int, int]] = []
    try:
        while not run.done():
            t0 = time.perf_counter()
            size, progress = run.next_size(), run.progress()
            lr = run.lr(size)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            first = schedule.samples
            batch = run.data.batch(first, size)
            if faults is not None:
                batch = faults(first, batch)
            samples = batch_size(batch)  # fewer than size at the end of an epoch
            batch = kind.local(batch)
            if run.device.type == "cuda":
                batch = to_device(batch, run.device)
            with memory.phase("training"):
                result = kind.step(run.acc, batch, run.micro_batch, run.recipe.loss_fn)
            schedule.update(result, samples)
            if schedule.kind == "auto":
                # Each rank reads the noise off its own prefixes: rank 0's decision holds.
                schedule.current = launch.main_int(schedule.current)
            step = schedule.step
            recent = [*recent[-20:], (step, first, first + samples)]
            run.elapsed = before + time.perf_counter() - began
            # The loss and gradient norm are global, so every rank judges alike.
            incident = (
                None
                if run.guard is None
                else run.guard.check(result.loss, result.grad_norm, result.skipped is not None)
            )
            if incident is not None:
                gave_up = _rollback(run, incident, recent[-incident.windows :], log)
                metrics.close()
                metrics = folder.open_metrics(schedule.step) if run.main else open(os.devnull, "w")
                if events is not None:
                    events.restart(schedule.step)
                if bar is not None:
                    bar.n = schedule.samples if run.total_samples is not None else schedule.step
                    bar.refresh()
                recent, last = [], schedule.step
                if gave_up:
                    run.stopped_by = "guard"
                    break
                continue
            run.skip_ahead()
            if step > run.last_incident:
                run.retries = 0  # past the trouble: the next incident starts a new count
            items += result.count
            interval = result.noise_interval or (None, None)
            line = {
                "step": step,
                "samples": schedule.samples,
                "effective_batch": samples,
                "loss": result.loss,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "count": result.count,
                "micro_batches": result.micro_batches,
                "seconds": time.perf_counter() - t0,
                "skipped": result.skipped,
                "oom_replays": result.oom_replays,
                "noise_scale": result.noise_scale,
                "noise_low": interval[0],
                "noise_high": interval[1],
            }
            memory.window_done()
            end = run.done()
            limit = run.targets.limit_reached(run.elapsed, memory.peak())
            if kind.evaluates() and (step % cfg.output.eval_every == 0 or end or limit):
                with memory.phase("evaluation"):
                    evaluated = run.data.evaluate(kind.evaluated(run.model), run.eval_size)
                line.update({f"eval_{k}": v for k, v in evaluated.items()})
            # the run's peak so far: its windows, evaluations, checkpoints and exports
            line["peak_memory"] = memory.peak()
            hit = run.targets.check(line, run.elapsed) if run.main else None
            _write_line(metrics, line, folder, last)
            if events is not None:
                try:
                    events.write(line, run.acc.state)
                except ValueError as err:
                    raise ValueError(_stopped(folder, str(err), last)) from None
            rate = items / max(time.perf_counter() - began, 1e-9)
            _report_step(bar, log, line, rate, run, progress)
            # Whether to stop is decided once, here: a signal that arrives after this point
            # waits for the next window boundary. (Reading `stop` again later let a signal
            # landing between the ranks' agreement and the check stop one rank alone, leaving
            # the other in a collective.)
            hit = launch.broadcast(hit)  # rank 0 evaluates: its verdict stops every rank
            stopping = launch.any_rank(bool(stop))  # a signal on any rank stops them all
            if stopping or hit or step % cfg.output.checkpoint_every == 0 or end:
                with memory.phase("checkpoint"):
                    _checkpoint(run, step, last)
                last = step
            every = cfg.output.export_every
            exporting = bool(every and step % every == 0 or end or hit)
            # A model held in shards is gathered whole (every rank takes part) once, for
            # model.pt at the end and for the Hugging Face export; None where it is whole.
            whole = None
            writes = exporting and cfg.source.hf_model is not None
            if end or hit or writes:
                whole = kind.gather(run.model)
            if writes or whole is not None:
                with memory.phase("export"):
                    if exporting:
                        _export(run, log, whole)
                    if whole is not None and (end or hit):
                        _save_whole(run, log, whole)
                del whole
            if stopping:
                signum = stop[0] if stop else signal.SIGTERM
                raise Interrupted(step, folder.path, signum, getattr(log, "failure", None))
            if hit:
                run.stopped_by = hit
                log(f"stopping at step {step}: {_hit_text(run.targets, hit)}")
                break
    finally:
        with contextlib.suppress(OSError):  # (a write that failed is already said)
            metrics.close()
        if run.main and memory.phases:
            # what each part of this session peaked at, for the plan's prediction to be
            # judged by (bench/planner.py)
            with contextlib.suppress(OSError, ValueError):
                folder.write_json(
                    MEMORY,
                    {"peak": memory.peak(), "phases": memory.phases, "carried": run.carried},
                )
        if events is not None:
            events.close()
        if bar is not None:
            bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hit_text(targets: Targets, name: str) -> str:
    seen = targets.observed[name]["value"]
    if name == "target_loss":
        return f"held-out loss {seen:.4f} <= target {targets.target_loss:g}"
    if name == "target_accuracy":
        return f"held-out accuracy {seen:.4f} >= target {targets.target_accuracy:g}"
    if name == "max_time":
        return f"{seen:.1f} s of training reached --max-time ({targets.max_time:g} s)"
    return (
        f"peak memory {format_bytes(seen)} reached --max-memory "
        f"({format_bytes(targets.max_memory or 0)})"
    )


def _events(run: _Run, log):
    """The TensorBoard writer (rank 0, when asked for and installed), else None."""
    from gradaccum.app.report import events

    if not (run.main and run.cfg.output.tensorboard):
        return None
    if not events.available():
        log(
            "TensorBoard: the tensorboard package is not installed, so no event files "
            "(pip install 'gradaccum[tensorboard]'); metrics.jsonl has every number"
        )
        return None
    return events.EventLog(run.folder.path, run.start, run.cfg.numerics.max_grad_norm or None)


def _rollback(run: _Run, incident: Incident, blamed: list[tuple[int, int, int]], log) -> bool:
    """Back to the newest kept checkpoint from before the blamed windows, their samples set
    aside, the incident recorded. Returns True when the guard gives up: after GUARD_RETRIES
    rollbacks in a row that did not get past the incident's step, the run stops there."""
    step = blamed[-1][0]
    kept = [(s, f) for s, f in run.folder.kept_checkpoints() if s < blamed[0][0]]
    if not kept:  # cannot happen while the folder is intact: the run keeps its first state
        raise ValueError(
            f"the incident guard found a {incident.kind} at step {step} but {run.folder.path} "
            "holds no kept checkpoint to roll back to; resume with --no-guard"
        )
    back, saved, unusable = _rollback_target(run, kept)  # restored
    gave_up = run.retries >= GUARD_RETRIES or not incident.blames_data
    span = [blamed[0][1], blamed[-1][2]]
    where = f"the run is back at step {back}" + (f" ({unusable})" if unusable else "")
    if not incident.blames_data:
        grew = incident.seen["loss"] / incident.seen["first_loss"]
        action = (
            f"stopped: the loss grew {grew:.3g}x over the first window's in the warm-up, which "
            "is the optimization diverging (too high a learning rate?), not bad data: nothing "
            f"set aside; {where}"
        )
    elif gave_up:
        judged = (
            ""
            if run.kind.world != 1
            else ", whose state scores its own last window within the guard's band"
        )
        action = (
            f"stopped: {run.retries} rollbacks in a row did not get past it; the run is back "
            f"at step {back}{judged}" + (f" ({unusable})" if unusable else "")
        )
    else:
        run.retries += 1
        run.last_incident = step
        for _, first, end in blamed:
            if [first, end] not in run.skips:
                run.skips.append([first, end])
        run.skip_ahead()
        action = (
            f"rolled back to step {back}; samples {span[0]:,} to {span[1]:,} set aside "
            f"(rollback {run.retries} of at most {GUARD_RETRIES} in a row)"
            + (f" ({unusable})" if unusable else "")
        )
    # The checkpoint again, now with the samples set aside: a resumed run decides alike.
    _checkpoint(run, back, back)
    if run.main:
        seen = {k: round(v, 6) for k, v in incident.seen.items()}
        record = {
            "step": step,
            "samples": span,
            "kind": incident.kind,
            "seen": seen,
            "action": action,
            "rolled_back_to": back,
            "retry": run.retries,
        }
        run.folder.append_line(INCIDENTS, record)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in incident.seen.items())
    log(f"incident at step {step}: {incident.kind} ({shown}); {action}")
    return gave_up


def _rollback_target(run: _Run, kept: list[tuple[int, Path]]):
    """(step, checkpoint, what was passed over) of the newest kept checkpoint whose state
    passes the guard itself: every weight and optimizer entry finite, and (one process) the
    restored model scoring the window it last trained on within the guard's band. A target
    that fails is a bad state, never called good: an older one is tried; none left is a
    ValueError."""
    passed = []
    for back, file in reversed(kept):
        saved = run.kind.load_saved(run.folder, run.device, file)
        if not _finite(saved["accumulator"]):
            passed.append(f"step {back} holds non-finite weights")
            continue
        run.restore(saved, rollback=True)
        problem = _probe(run, back)
        if problem is None:
            return back, saved, "; ".join(passed)
        passed.append(f"step {back} {problem}")
    raise ValueError(
        "the incident guard would roll back, but no kept checkpoint holds a good state ("
        + "; ".join(passed)
        + "): the run went bad before them; start a new run (a lower --lr?)"
    )


def _probe(run: _Run, back: int) -> str | None:
    """What is wrong with the state just restored at step ``back``: its loss on the samples
    of step ``back``'s window (which the guard accepted when it trained on them) non-finite
    or above the guard's band, or None. Forward only, nothing of the run changed (buffers
    and random generators are put back). One process only: elsewhere every rank would have
    to agree on the shards' sum, and a pipeline's forward is its schedule."""
    from gradaccum.batching import split
    from gradaccum.checkpoint import preserved_rng

    highest = run.guard.highest_loss() if run.guard is not None else None
    if back == 0 or highest is None or run.kind.world != 1:
        return None
    line = next((x for x in reversed(run.folder.metrics()) if x.get("step") == back), None)
    if line is None or not line.get("effective_batch"):
        return None
    size = int(line["effective_batch"])
    batch = run.data.batch(int(line["samples"]) - size, size)
    buffers = {k: v.clone() for k, v in run.model.named_buffers()}
    total = count = 0.0
    with torch.no_grad(), preserved_rng():
        for mb in split(to_device(batch, run.device), run.micro_batch):
            loss_sum, n = run.recipe.loss_fn(run.model, mb)
            total += float(loss_sum)
            count += float(n)
    for name, value in run.model.named_buffers():
        value.copy_(buffers[name])
    loss = total / max(count, 1.0)
    if not math.isfinite(loss) or loss > highest:
        return f"scores its own last window at loss {loss:.4g}, above the guard's {highest:.4g}"
    return None


def _finite(state: Any) -> bool:
    """Whether every floating-point tensor in a (nested) state is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def _write_line(metrics, line: dict[str, Any], folder: RunFolder, last: int) -> None:
    try:
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()
    except OSError as err:
        what = f"cannot write {folder.path / METRICS}: {err.strerror or err}"
        with contextlib.suppress(OSError):  # what is still buffered would fail again
            metrics.close()
        raise ValueError(_stopped(folder, what, last)) from None


def _checkpoint(run: _Run, step: int, last: int) -> None:
    """checkpoint.pt written by rank 0, after the parts other processes write themselves
    (a pipeline's later stages, FSDP2's shards: ``RunKind.save_parts``)."""
    try:
        accumulator = run.kind.save_parts(run.acc, run.folder, step)
    except ValueError as err:
        raise ValueError(_stopped(run.folder, str(err), last)) from None
    if not run.main:
        return
    state = {
        "step": step,
        "micro_batch": run.micro_batch,
        "sync": run.kind.sync_mode(run.acc),
        "checkpointing": run.checkpointing,
        "signature": run.signature,
        "schedule": run.schedule.state_dict(),
        "accumulator": accumulator or run.acc.state_dict(),
        "guard": None if run.guard is None else run.guard.state_dict(),
        "skips": run.skips,
        "retries": run.retries,
        "last_incident": run.last_incident,
        "elapsed": run.elapsed,
        "targets": run.targets.observed,
    }
    try:
        run.folder.save_checkpoint(state)
        if run.guard is not None:
            run.folder.keep_checkpoint(step, run.cfg.incidents.keep_checkpoints)
        run.kind.prune(run.folder, {step, *(s for s, _ in run.folder.kept_checkpoints())})
    except ValueError as err:
        raise ValueError(_stopped(run.folder, str(err), last)) from None


def _save_whole(run: _Run, log, whole: dict[str, torch.Tensor]) -> None:
    """model.pt, written by rank 0: plain tensors under the model's own names, for
    ``model.load_state_dict(torch.load(path, weights_only=True))`` anywhere."""
    if run.main:
        try:
            run.folder.save_model(whole)
        except ValueError as err:
            raise ValueError(_stopped(run.folder, str(err), run.schedule.step)) from None
        log(f"wrote {run.folder.path / MODEL}: the whole model, gathered from the shards")


def _export(run: _Run, log, whole: dict[str, torch.Tensor] | None = None) -> None:
    """The exports (``exports.write_exports``), written by rank 0."""
    if not run.main:
        return
    written = write_exports(run.cfg, run.model, run.folder.path / "export", whole)
    if written:
        log("exported " + ", ".join(str(w) for w in written))


def _stopped(folder: RunFolder, what: str, last: int) -> str:
    if folder.removable():  # before its first step: RunFolder.abandon removes it
        return (
            f"{what}; the run stopped before its first step and its folder is removed: free "
            "the space and run the same command again"
        )
    kept = f"its last checkpoint (step {last}) is kept" if last else "no checkpoint yet"
    return (
        f"{what}; training stopped, {kept}; free the space and continue with: "
        f"gradaccum train --resume {folder.path}"
    )


def _quiet(*args: Any, **kwargs: Any) -> None:
    """The log of ranks other than 0: rank 0 speaks for the job."""


def _report_step(bar, log, line: dict[str, Any], rate: float, run: _Run, before: float) -> None:
    """The bar's postfix on a terminal; else a log line at each tenth of the run, at its end
    and at each evaluation (``before``: the share of the run done before this step)."""
    loss = "skipped" if line["loss"] is None else f"{line['loss']:.3f}"
    item = run.recipe.item
    text = (
        f"loss {loss} nats/{item}  {rate:,.0f} {item}s/s  mem {format_bytes(line['peak_memory'])}"
    ) + (f"  held-out {line['eval_loss']:.3f}" if "eval_loss" in line else "")
    # The recipe's other held-out measures (accuracy, IoU), by their names.
    text += "".join(
        f" {k[5:]} {v:.3f}" for k, v in line.items() if k.startswith("eval_") and k != "eval_loss"
    )
    if bar is not None:
        bar.set_postfix_str(text)
        bar.update(line["effective_batch"] if run.total_samples is not None else 1)
        return
    now = run.progress()
    if int(now * 10) > int(before * 10) or now >= 1 or "eval_loss" in line:
        where = (
            f"{line['step']:>5}  {line['samples']:>7,}/{run.total_samples:,} samples"
            if run.total_samples is not None
            else f"{line['step']:>5}/{run.total_steps}"
        )
        left = run.elapsed * (1 - now) / now if 0 < now < 1 else 0.0
        eta = f"  ETA {_duration(left)}" if left >= 1 else ""
        log(f"step {where}  {text}{eta}")


def _duration(seconds: float) -> str:
    """45s, 3m05s, 1h02m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
