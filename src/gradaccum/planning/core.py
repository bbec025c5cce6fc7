"""plan(): the largest micro-batch that fits a memory budget, measured, not guessed.

One warm-up step, then a few probe micro-batch sizes, each a real window through the real
Accumulator (forward, backward, normalization, optimizer step). Each probe measures the
peak memory above its start and the activation bytes saved for backward. A straight line
through the peaks, plus the static memory (parameters, optimizer state, buffers, counted
tensor by tensor after the warm-up step), predicts the peak of any micro-batch size. The
largest size whose prediction, times (1 + margin), fits the budget is the plan; the
effective batch stays exact (micro-batches balanced, the last one may be smaller).

The model, the optimizer and the random state are restored afterwards: planning leaves no
trace. Lives above the engine because it drives it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors
from gradaccum.checkpoint import preserved_rng
from gradaccum.engine import LossFn
from gradaccum.memory import MemoryMeter, format_bytes
from gradaccum.planning.phases import measure_phases
from gradaccum.planning.prober import Measured, Prober
from gradaccum.planning.request import CHECKPOINTING, PlanRequest
from gradaccum.planning.result import STEPPED_UP, Plan, Probe
from gradaccum.planning.speed import (
    Extra,
    Race,
    Timing,
    WindowCost,
    candidates,
    race,
    without_checkpointed,
)
from gradaccum.recompute import (
    checkpointing_enabled,
    disable_checkpointing,
    enable_checkpointing,
    repeated_blocks,
)
from gradaccum.sync import SYNC_MODES, is_sharded, one_process

__all__ = ["CHECKPOINTING", "plan", "too_small"]


@one_process()  # rank 0 plans for every rank on its own, plain model
def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    loss_fn: LossFn,
    *request: Any,
    verify: Callable[[int, int, bool], int] | None = None,
    phases: Mapping[str, Callable[[int], Any]] | None = None,
    **settings: Any,
) -> Plan:
    """Plan the micro-batch for ``effective_batch`` samples (over all ranks) in ``budget``.

    ``request``: a ``PlanRequest`` (``plan(model, optimizer, sample, loss_fn, request)``),
    or its fields as keywords (``effective_batch=256, budget="2GiB", margin=0.15, ...``;
    keywords given with a request replace its fields). ``sample_batch``: a batch at its
    largest shape (longest sequences); its samples are repeated when a probe needs more of
    them (memory depends on shapes, not values).

    After the fit, a window at the planned size is measured too, and the size steps down
    until it fits: in this process by default, or by ``verify(micro_size, micro_batches,
    checkpointing) -> peak bytes``, which ``gradaccum plan`` points at a fresh process
    (where training will run, and where CPU memory is not shaped by the probes before it).

    ``phases``: the run's other parts, ``{"evaluation": fn, "checkpoint": fn, ...}``, each
    ``fn(micro_size)`` run in this process after the planned window (the optimizer state
    held, as in training) and measured: the plan's ``phases`` and ``run_peak`` cover the
    whole run. A phase over the usable budget at the planned micro-batch is measured again
    at half the size, and half again, and gets a micro-batch of its own
    (``plan.phase_size(name)``); one that does not fit at one sample is refused.

    With ``sync="auto"`` under FSDP2 both sync modes are measured (every rank calls
    ``plan`` together, and the fullest rank's measurements decide): ``"window"`` (one
    reduce-scatter per window, the whole unsharded gradient held between micro-batches)
    when it fits, else ``"micro"``; the plan's notes give both predictions and why.
    """
    asked = PlanRequest.of(*request, **settings)
    if asked.sync == "auto":
        return _plan_sync(model, optimizer, sample_batch, loss_fn, asked, verify, phases)
    state = _Planning.start(model, optimizer, sample_batch, loss_fn, asked, verify, phases)
    # the probes' dropout and data order must not advance any generator
    with preserved_rng(), _heap_set_aside():
        try:
            state.fit()
            state.checkpointed()
            state.race()
            state.remeasure()
            state.run_phases()
        finally:
            _restore(model, optimizer, state.saved)
    return state.result()


class _Planning:
    """One plan's state as its stages fill it in, in order: ``fit`` (the line that fits,
    checkpointing tried before refusing where "auto"), ``checkpointed`` ("auto" with a size
    that fits: whether recomputing fits a larger one), ``race`` (the fastest of the sizes
    up to the one measured to fit, a checkpointed winner verified where training runs),
    ``remeasure`` (a smaller size the race chose, measured fresh), ``run_phases`` (the
    run's other parts at the chosen size); then ``result``, the ``Plan``."""

    @classmethod
    def start(cls, model, optimizer, sample_batch, loss_fn, asked, verify, phases) -> _Planning:
        """The request checked (every problem in one line), and what every stage uses."""
        problems = asked.problems()
        sample_n = 0
        try:
            sample_n = batch_size(sample_batch)
        except (TypeError, ValueError) as err:
            problems.append(f"sample_batch: {err}")
        if problems:
            raise ValueError("cannot plan: " + "; ".join(problems))
        if sample_n == 0:
            raise ValueError("cannot plan: sample_batch holds no sample")
        return cls(model, optimizer, sample_batch, loss_fn, asked, verify, phases, sample_n)

    def __init__(self, model, optimizer, sample_batch, loss_fn, asked, verify, phases, n):
        self.model, self.optimizer, self.sample_batch, self.loss_fn = (
            model, optimizer, sample_batch, loss_fn,
        )  # fmt: skip
        self.asked, self.verify, self.phases = asked, verify, phases
        self.per_rank, self.budget_bytes, self.margin = (
            asked.per_rank, asked.budget_bytes(), asked.margin,
        )  # fmt: skip
        if asked.probe_sizes is None:
            self.probe_sizes = [s for s in (1, 2, 4, 8) if s <= max(2, self.per_rank)]
        else:
            self.probe_sizes = sorted(set(asked.probe_sizes))
        self.device = next(p for p in model.parameters()).device
        self.memory = MemoryMeter(self.device, asked.meter)
        self.started = time.perf_counter()
        self.saved = {
            "model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(optimizer.state_dict()),
            "checkpointing": checkpointing_enabled(model),
        }
        self.usable = self.budget_bytes * (1 - self.margin)
        # The window's input batch is held while it trains (``acc.step(ga.split(batch, m))``):
        # its bytes, per sample as in the sample batch, are part of the window's need.
        self.batch_bytes = round(_input_bytes(sample_batch) / n * self.per_rank)
        self.line: _Line = None  # type: ignore[assignment]  # (fit)
        self.lines: list[_Line] = []
        self.raced_note: str | None = None
        self.race_budget = 0.0
        self.raced: Race | None = None
        self.timings: tuple[Timing, ...] = ()
        self.micro_size, self.chosen, self.remeasured = 0, None, ()
        self.need, self.measured_phases = 0, None

    def measure(self, use_ckpt: bool, after: _Line | None = None, fresh: bool = True) -> _Line:
        asked = self.asked
        prober = Prober(
            self.model,
            self.optimizer,
            self.sample_batch,
            self.loss_fn,
            use_ckpt,
            asked.precision,
            asked.accumulate_dtype,
            self.memory,
            asked.sync,
            self.batch_bytes,
        )
        # A process pays its one-time bytes (thread pools, workspaces) on its first step: a
        # line measured after another in this process sees them already paid, and a fresh
        # training process would not. It keeps the first line's.
        paid = after.m.overhead if after is not None else 0
        check = self.verify if fresh else None
        return _Line.measure(prober, self.probe_sizes, self.per_rank, self.usable, check, paid)

    def fit(self) -> None:
        """The line that fits: nothing fitting as it is, by the line or measured at one
        sample per micro-batch, "auto" tries recomputing activations before refusing."""
        asked, use_ckpt, line = self.asked, self.asked.checkpointing == "on", None
        while True:
            line = self.measure(use_ckpt, line)
            if line.fits:
                break
            if asked.checkpointing != "auto" or use_ckpt:
                raise ValueError(
                    too_small(
                        self.model, self.budget_bytes, self.margin, use_ckpt, line.need,
                        line.verified,
                    )
                )  # fmt: skip
            use_ckpt = True
            _restore(self.model, self.optimizer, self.saved)
        self.line, self.lines = line, [line]

    def checkpointed(self) -> None:
        """ "auto" with a size that fits without: whether recomputing fits a larger one, its
        line measured in this process (a fresh process only for a winner). What timing may
        add is half of what the plan took so far (planning grows by half at most), this
        line's measurement and verification included."""
        line = self.line
        allowed = 0.5 * (time.perf_counter() - self.started)
        self.race_budget = allowed
        extra = _checkpointed_extra(
            self.model, self.asked, line, self.probe_sizes, self.per_rank, allowed
        )
        if extra is not None and not extra.affordable:
            self.raced_note = extra.why_not()
        elif extra is not None:
            _restore(self.model, self.optimizer, self.saved)
            began = time.perf_counter()
            try:
                ckpt = self.measure(True, line, fresh=False)
            except torch.OutOfMemoryError:  # a device ran out on its second probe
                ckpt = None
            spent = time.perf_counter() - began
            self.raced_note = _checkpointed_note(line, ckpt, spent)
            self.race_budget = allowed - spent
            if ckpt is not None and ckpt.fits and ckpt.micro_size > line.micro_size:
                self.lines.append(ckpt)
                self.race_budget = extra.race_budget(spent)

    def race(self) -> None:
        """The fastest of the sizes up to the one measured to fit; a checkpointed winner
        measured where training runs, in the time held back."""
        lines, line = self.lines, self.line
        raced = _race(lines, self.asked, self.per_rank, self.race_budget)
        if raced is not None and raced.chosen > line.micro_size and self.verify is not None:
            lines[-1] = _verified_fresh(lines[-1], self.verify, self.per_rank, self.usable)
            if not lines[-1].fits:
                refused = (
                    f"activation checkpointing's {raced.chosen}, timed faster, peaked at "
                    f"{format_bytes(lines[-1].need)} in a fresh process, above the "
                    f"{format_bytes(self.usable)} usable"
                )
                raced = without_checkpointed(raced, refused)
        self.raced, self.timings = raced, _timings(raced, lines)
        self.micro_size, self.chosen = line.micro_size, line
        if raced is not None:
            self.micro_size = raced.chosen
            self.chosen = lines[-1] if self.micro_size > line.micro_size else line

    def remeasure(self) -> None:
        """A smaller size than the one measured, chosen by the race, measured in a fresh
        process: the line reads it by what the measured size sat above the line, and a
        process's one-time bytes stay while glibc's steeper slope does not (gpt at 16 of
        32: read 19% above its run). After the race and on top of its half: held back
        from the race, one fresh process's seconds left segment's race no window."""
        line, raced, micro_size = self.line, self.raced, self.micro_size
        if raced is not None and micro_size < line.micro_size and self.verify is not None:
            probe, _ = _fresh_probe(line.m, micro_size, self.verify, self.per_rank)
            measured = line.m.base + probe.peak_bytes
            if measured <= self.usable:
                self.remeasured = (probe,)
                self.timings = tuple(
                    replace(t, peak_bytes=measured) if t.micro_size == micro_size else t
                    for t in self.timings
                )
            else:  # above what the line read: the largest, measured, instead
                refused = (
                    f"{micro_size}, timed faster, peaked at {format_bytes(measured)} in a "
                    f"fresh process, above the {format_bytes(self.usable)} usable"
                )
                self.raced = replace(
                    raced, chosen=line.micro_size, why=f"the largest that fits; {refused}"
                )
                self.micro_size = line.micro_size
        self.need = next(
            (t.peak_bytes for t in self.timings if t.micro_size == self.micro_size), line.need
        )

    def run_phases(self) -> None:
        """The run's other parts as training will run them, its checkpointing on."""
        chosen = self.chosen
        (enable_checkpointing if chosen.m.blocks else disable_checkpointing)(self.model)
        self.measured_phases = measure_phases(
            self.phases or {}, self.memory, chosen.m, self.micro_size, self.usable,
            self.budget_bytes, self.margin,
        )  # fmt: skip

    def result(self) -> Plan:
        asked, chosen, raced, micro_size = self.asked, self.chosen, self.raced, self.micro_size
        m, per_rank = chosen.m, self.per_rank
        micro_batches = math.ceil(per_rank / micro_size)
        notes = list(m.notes)
        # (a line off by more than 5%: Plan.summary() says so, and how the size was found)
        if self.raced_note:
            notes.append(self.raced_note)
        return Plan(
            effective_batch=asked.effective_batch,
            world_size=asked.world_size,
            per_rank_batch=per_rank,
            micro_size=micro_size,
            micro_batches=micro_batches,
            last_micro_size=per_rank - (micro_batches - 1) * micro_size,
            budget=self.budget_bytes,
            margin=float(self.margin),
            # what training will peak at is what the planned size peaked at, measured as it
            # will run; the fit only chose the size to measure
            predicted_peak=self.need,
            static_bytes=m.static,
            overhead_bytes=m.overhead,
            batch_bytes=m.batch,
            bytes_per_sample=m.peak_fit.slope,
            peak_fit=m.peak_fit,
            activation_fit=m.activation_fit,
            probes=m.probes + chosen.checked + self.remeasured,
            checkpointing=bool(m.blocks),
            checkpointed_blocks=m.blocks,
            device=str(self.device),
            seconds=time.perf_counter() - self.started,
            largest_fitting=chosen.largest,
            notes=tuple(notes),
            precision=asked.precision,
            sync=asked.sync,
            phases=self.measured_phases,
            prefer=asked.prefer,
            timings=self.timings,
            choice=raced.why if raced is not None else "",
            timing_seconds=raced.spent if raced is not None else 0.0,
        )


@dataclass(frozen=True)
class _Line:
    """One memory line (with or without checkpointing, as its prober runs) and its planned
    size verified: ``need``, the whole peak of the deciding measurement (or the line's
    prediction at one sample, ``verified`` False, when even that is over the budget)."""

    prober: Prober
    m: Measured
    need: float
    verified: bool
    fits: bool
    largest: int = 0
    micro_size: int = 0
    checked: tuple[Probe, ...] = ()
    fresh_s: float = 0.0  # the longest of its fresh-process verifications, in seconds

    @classmethod
    def measure(cls, prober, probe_sizes, per_rank, usable, verify, overhead=0) -> _Line:
        """``overhead``: the least first-step overhead to count (what an earlier line in
        this process measured)."""
        m = prober.measure(probe_sizes, usable)
        if overhead > m.overhead:
            m = replace(m, overhead=overhead)
        if m.need(1) > usable:
            return cls(prober, m, m.need(1), verified=False, fits=False)
        largest = min(per_rank, int((usable - m.need(0)) // max(m.peak_fit.slope, 1.0)))
        largest, micro_size, checked, fresh_s = _verify(
            prober, m, per_rank, largest, usable, verify
        )
        need = m.base + checked[-1].peak_bytes
        return cls(prober, m, need, True, need <= usable, largest, micro_size, checked, fresh_s)


def _checkpointed_extra(
    model: torch.nn.Module,
    asked: PlanRequest,
    line: _Line,
    probe_sizes: list[int],
    per_rank: int,
    allowed: float,
) -> Extra | None:
    """What racing checkpointing's size would add, estimated from ``line``'s windows, where
    it may race a larger size: "auto" and "fastest" asked, the planned size without it below
    the per-rank batch, blocks to recompute, and one process timing (ranks planning together
    are not timed); None where it may not."""
    races = (
        asked.prefer == "fastest"
        and asked.checkpointing == "auto"
        and not line.m.blocks
        and line.micro_size < per_rank
        and not line.prober.acc.sync.distributed
        and bool(repeated_blocks(model))
    )
    if not races:
        return None
    return Extra.estimate(
        allowed,
        WindowCost.fit(line.prober.windows),
        line.fresh_s,
        probe_sizes=probe_sizes,
        sizes=candidates(per_rank, line.micro_size),
        per_rank=per_rank,
    )


def _verified_fresh(
    line: _Line, verify: Callable[[int, int, bool], int], per_rank: int, usable: float
) -> _Line:
    """``line``'s size (measured in this process) measured again by ``verify``, where training
    runs, that measurement deciding: over ``usable``, the line no longer fits."""
    probe, fresh_s = _fresh_probe(line.m, line.micro_size, verify, per_rank)
    need = line.m.base + probe.peak_bytes
    return replace(
        line, need=need, fits=need <= usable, checked=(*line.checked, probe), fresh_s=fresh_s
    )


def _fresh_probe(
    m: Measured, size: int, verify: Callable[[int, int, bool], int], per_rank: int
) -> tuple[Probe, float]:
    """A window at ``size`` measured by ``verify`` (where training runs; two micro-batches at
    most) on ``m``'s line, as a probe above its static and one-time bytes, and its seconds."""
    began = time.perf_counter()
    peak = int(verify(size, min(math.ceil(per_rank / size), 2), bool(m.blocks)))
    peak -= m.static + m.overhead
    act, line_at = int(m.activation_fit(size)), m.peak_fit(size)
    probe = Probe(size, peak, act, line_at, kind="verify, fresh process")
    return probe, time.perf_counter() - began


def _checkpointed_note(line: _Line, ckpt: _Line | None, seconds: float) -> str:
    """What measuring the checkpointed line found, and what it cost."""
    cost = f"(its line, measured in this process, took {seconds:.1f} s of the planning)"
    if ckpt is None or not ckpt.fits:
        return f"activation checkpointing measured: it fits no micro-batch here {cost}"
    if ckpt.micro_size <= line.micro_size:
        return (
            f"activation checkpointing measured: it fits micro-batch {ckpt.micro_size}, no "
            f"larger than {line.micro_size} without it, so it was not raced {cost}"
        )
    return (
        f"activation checkpointing raced: micro-batch {ckpt.micro_size} fits with it "
        f"({format_bytes(ckpt.need)} measured), {line.micro_size} without "
        f"({format_bytes(line.need)}) {cost}"
    )


def _race(lines: list[_Line], asked: PlanRequest, per_rank: int, budget_s: float) -> Race | None:
    """With ``prefer="fastest"``, the size measured to fit and smaller ones (and the size
    that fits only with checkpointing, where ``lines`` has its line) timed against each
    other in at most ``budget_s``; None: untimed (``"largest"``, a single candidate, or
    ranks that would each time their own)."""
    plain, prober = lines[0], lines[-1].prober
    if asked.prefer != "fastest" or prober.acc.sync.distributed:
        return None
    sizes = candidates(per_rank, plain.micro_size)
    # a line measured with checkpointing on times its sizes with it, as training will run
    # them: every size (checkpointing "on", or "auto" when nothing fitted without it), or
    # the size that fits only with it
    checkpointed = sizes if plain.m.blocks else [line.micro_size for line in lines[1:]]
    every = sorted({*sizes, *checkpointed})
    if len(every) < 2:
        return None
    return race(
        prober.timed,
        every,
        per_rank,
        budget_s,
        checkpointed=checkpointed,
    )


def _timings(raced: Race | None, lines: list[_Line]) -> tuple[Timing, ...]:
    """Each timed size with the peak the plan predicts for it, on its own line (with or
    without checkpointing): measured at the deciding size; below it, the line plus what the
    deciding measurement sat above the line (a fresh process's one-time bytes stay whatever
    the size), never above the measurement."""
    if raced is None:
        return ()

    def peak(size: int, checkpointed: bool) -> float:
        line = next(line for line in lines if bool(line.m.blocks) == checkpointed)
        m, deciding = line.m, line.checked[-1]
        measured = m.base + deciding.peak_bytes
        if size == deciding.micro_size:
            return measured
        above = max(0.0, deciding.peak_bytes - m.peak_fit(deciding.micro_size))
        return min(m.base + m.peak_fit(size) + above, measured)

    return tuple(replace(t, peak_bytes=peak(t.micro_size, t.checkpointed)) for t in raced.timings)


def _plan_sync(model, optimizer, sample_batch, loss_fn, asked: PlanRequest, verify, phases):
    """``plan(sync="auto")``: under FSDP2, both sync modes measured; "window" when it fits."""
    args = (model, optimizer, sample_batch, loss_fn)
    if not is_sharded(model):  # DDP holds the whole gradient either way
        return plan(*args, replace(asked, sync="window"), verify=verify, phases=phases)
    plans: dict[str, Plan | ValueError] = {}
    for mode in SYNC_MODES:
        try:
            plans[mode] = plan(*args, replace(asked, sync=mode), verify=verify, phases=phases)
        except ValueError as err:  # the budget is too small for this mode
            plans[mode] = err
    window, micro = plans["window"], plans["micro"]
    if isinstance(window, Plan):
        chosen = window
    elif isinstance(micro, Plan):
        chosen = micro
    else:
        raise window
    size = chosen.micro_size

    def predicted(p: Plan | ValueError) -> str:
        if not isinstance(p, Plan):
            return "does not fit at micro-batch 1"
        at = p.predicted_peak if p.micro_size == size else p.predict(size)
        return f"{format_bytes(at)} at micro-batch {size}"

    why = (
        "it fits, with one reduce-scatter per window"
        if chosen is window
        else "holding the whole unsharded gradient between micro-batches does not fit"
    )
    line = (
        f"gradient sync {chosen.sync}: predicted per rank, window {predicted(window)}, micro "
        f"{predicted(micro)}, of {format_bytes(chosen.budget * (1 - chosen.margin))} usable; "
        f"{why}"
    )
    return replace(chosen, notes=(*chosen.notes, line))


def _input_bytes(batch: Any) -> int:
    """Bytes of every tensor in a batch as its own (a repeated or expanded sample counts as
    many times as it appears: the run's batches are made of distinct samples)."""
    sizes: list[int] = []
    map_tensors(batch, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


@contextlib.contextmanager
def _heap_set_aside():
    """While planning, the objects that existed before it (the program's modules and data)
    are set aside from the collector (``gc.freeze``), so the ``gc.collect()`` before each
    probe walks only what planning made: a full collection of a process that imported
    transformers takes about 0.3 s here, and planning runs a dozen. Nothing is freed or
    kept by it; the heap is unfrozen after. A program that froze its heap itself keeps it."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()  # today's garbage is freed, not set aside
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _verify(
    prober: Prober,
    m: Measured,
    per_rank: int,
    largest: int,
    usable: float,
    verify: Callable[[int, int, bool], int] | None,
):
    """Measure a window at the planned size itself; step down while it does not fit.

    The line through small probes extrapolates; the allocator's behaviour at the planned
    size (fragmentation, kernel workspaces) is measured, not assumed. A window of two
    micro-batches is measured whatever the plan's count: from the second on, a window holds
    the first's summed gradient and nothing more (bench/results/memory_vs_n.md). When the
    measured peak is over, the line is scaled through it and the largest size that fits by
    the scaled line is measured next, by ``verify`` too: a fresh process sits above the
    probes' line by what a process pays once and, with glibc as it comes, by a slope
    steeper than the scaled line's, which read minilm's 5 from its 16 6% under its run
    (bench/results/planner.md). Scaling makes the process's one-time bytes grow with the
    size too, so the size it finds can sit far below what fits (minilm: 1 from a fresh 24,
    where 6 fitted): once a fresh measurement fits below one that did not, the line through
    the two is read once for a larger size between them, measured there too where it makes
    the window's micro-batches at least a third fewer, and planned only if it fits; its
    peak is the larger of that measurement and the line through the two. Returns the
    sizes' probes, the deciding one last, and the seconds of the longest fresh-process
    measurement (0: none).
    """

    def measured(micro_size: int, kind: str = "") -> tuple[Probe, float]:
        n = min(math.ceil(per_rank / micro_size), 2)
        began = time.perf_counter()
        if verify is not None:
            peak = int(verify(micro_size, n, bool(m.blocks))) - m.static - m.overhead
            act, kind = int(m.activation_fit(micro_size)), kind or "verify, fresh process"
        else:
            # The planned window, twice, keeping the larger peak: on CPU, RSS grows over
            # the first windows as malloc's free lists fragment.
            peak, act = max(prober.window(micro_size, micro_batches=n)[:2] for _ in range(2))
            kind = "verify"
        probe = Probe(micro_size, peak, act, m.peak_fit(micro_size), kind=kind)
        return probe, (time.perf_counter() - began if verify is not None else 0.0)

    def fits(probe: Probe) -> bool:
        return m.base + probe.peak_bytes <= usable

    checked: list[Probe] = []
    fresh_s = 0.0
    for _ in range(8):
        probe, seconds = measured(_balanced(per_rank, largest))
        checked.append(probe)
        fresh_s = max(fresh_s, seconds)
        if fits(probe) or probe.micro_size == 1:
            break
        # the line scaled to pass through this measurement (never below it)
        scale = max(1.0, probe.peak_bytes / max(m.peak_fit(probe.micro_size), 1.0))
        below = range(1, probe.micro_size)
        largest = max((s for s in below if m.base + scale * m.peak_fit(s) <= usable), default=1)
    if verify is not None and len(checked) > 1 and fits(checked[-1]):
        largest, seconds = _step_up(checked, largest, per_rank, usable, m.base, measured, fits)
        fresh_s = max(fresh_s, seconds)
    return largest, checked[-1].micro_size, tuple(checked), fresh_s


def _step_up(checked: list[Probe], largest: int, per_rank: int, usable: float, base: int,
             measured, fits) -> tuple[int, float]:  # fmt: skip
    """After a step down: the size the line through the last two fresh measurements reads
    between them (the last fits, the one before did not), measured where it makes the
    window's micro-batches a third fewer or more, ``checked`` with it in place (the deciding
    measurement last); the largest size that fits and the seconds measured. Its peak is
    never below the line through the two: a size read at the edge of the budget is planned
    only when its one draw fits, so a low draw is the one kept (bench/results/planner.md:
    minilm's run above its plan where it was not)."""
    low, high = checked[-1], checked[-2]
    per_sample = (high.peak_bytes - low.peak_bytes) / (high.micro_size - low.micro_size)
    between = low.micro_size + int((usable - base - low.peak_bytes) // per_sample)
    between = min(between, high.micro_size - 1)
    size = _balanced(per_rank, between)
    # a fresh process is worth it only where the window's micro-batches are a third fewer
    if 3 * math.ceil(per_rank / size) > 2 * math.ceil(per_rank / low.micro_size):
        return largest, 0.0
    probe, seconds = measured(size, STEPPED_UP)
    line_at = low.peak_bytes + per_sample * (size - low.micro_size)
    probe = replace(probe, peak_bytes=max(probe.peak_bytes, int(math.ceil(line_at))))
    if fits(probe):
        checked.append(probe)
        return between, seconds
    checked.insert(-1, probe)  # the deciding measurement stays last
    return largest, seconds


def _balanced(per_rank: int, largest: int) -> int:
    """The micro-batch size that splits ``per_rank`` into the fewest even micro-batches of at
    most ``largest``."""
    return math.ceil(per_rank / math.ceil(per_rank / largest))


def too_small(
    model: torch.nn.Module, budget: int, margin: float, ckpt: bool, need: float, measured: bool
) -> str:
    usable = budget * (1 - margin)
    return (
        f"budget {format_bytes(budget)} is too small for {type(model).__name__}: one sample "
        f"per micro-batch needs {'a measured' if measured else 'a predicted'} "
        f"{format_bytes(need)}"
        + (" even with activation checkpointing" if ckpt else "")
        + f", above the {format_bytes(usable)} usable after the {margin:.0%} margin; give at "
        f"least {format_bytes(need / (1 - margin))}"
        # checkpointing "auto" has tried recomputation before this refusal
         + ("" if ckpt else " or allow checkpointing='auto'")
    )


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    if saved["checkpointing"]:
        enable_checkpointing(model)
    else:
        disable_checkpointing(model)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    for p in model.parameters():
        p.grad = None
