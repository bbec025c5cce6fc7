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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors, take
from gradaccum.checkpoint import preserved_rng
from gradaccum.engine import Accumulator, LossFn
from gradaccum.export import Export, export
from gradaccum.memory import (
    METERS,
    MemoryMeter,
    format_bytes,
    parse_bytes,
    saved_activation_bytes,
    tensor_bytes,
)
from gradaccum.precision import Precision
from gradaccum.recompute import checkpointing_enabled, disable_checkpointing, enable_checkpointing
from gradaccum.stats import fit_line
from gradaccum.sync import SYNC_MODES, is_sharded, one_process
from gradaccum.validate import int_problem

__all__ = ["Fit", "Phase", "Plan", "Probe", "plan"]

CHECKPOINTING = ("off", "on", "auto")
_WARMUP_WINDOWS = 30


@dataclass(frozen=True)
class Fit:
    """``bytes = intercept + slope * micro_size``, least squares over the probes."""

    intercept: float
    slope: float
    max_error: float  # largest |residual| / measured over the probes
    bound: bool = False  # True: not least squares but the lowest line above every probe

    def __call__(self, micro_size: float) -> float:
        return self.intercept + self.slope * micro_size

    @property
    def plausible(self) -> bool:
        """A line that says something: it grows with the micro-batch, and it misses no probe
        by more than the probe's own value."""
        return self.slope > 0 and self.max_error <= 1.0

    def quality(self) -> str:
        """How far to trust the line, in words (the plan's summary and the report say this)."""
        if self.bound:
            return "a bound above every probe"  # and a note says why
        if not self.plausible:
            return (
                f"no plausible line (it misses a probe by {self.max_error:.0%}): the peak "
                "measured at the planned size is what counts"
            )
        return f"fit error {self.max_error:.1%}"

    def line(self) -> str:
        """``10.4 MiB + 32.2 KiB per sample``, each sign as it is (``1.9 MiB - 111 B``)."""
        start = ("-" if self.intercept < 0 else "") + format_bytes(abs(self.intercept))
        return f"{start} {signed_bytes(self.slope)} per sample"

    def activations(self) -> str:
        """This fit as the activations' line, or what was measured when the probes give no
        plausible one (a slope below zero, or a line off by more than the values)."""
        if not self.plausible:
            return (
                "too small here to fit a line per sample (the probes' values do not grow "
                "with the micro-batch); the peak is measured"
            )
        return f"{format_bytes(self.slope)} per sample (fit error {self.max_error:.1%})"


@dataclass(frozen=True)
class Probe:
    micro_size: int
    peak_bytes: int  # peak above the memory in use when the probe started
    activation_bytes: int  # saved for backward; storages once, parameters excluded
    predicted_bytes: float  # the peak fit at this size
    # "fit": a point of the line; "verify": the planned size, measured; "from the fresh
    # process's N, the line scaled": the line through a measurement over the budget
    kind: str = "fit"


@dataclass(frozen=True)
class Phase:
    """A part of the run other than the training window (evaluation, a checkpoint, an
    export), measured after the planned window: ``peak_bytes`` is the whole peak while it
    runs (static and first-step bytes included), at micro-batch ``micro_size``."""

    name: str
    micro_size: int
    peak_bytes: int
    tried: tuple[tuple[int, int], ...] = ()  # (size, whole peak) of sizes that did not fit


@dataclass(frozen=True)
class Plan:
    """What to run: per rank, ``micro_batches`` micro-batches of ``micro_size`` samples per
    window, the last one ``last_micro_size``; predicted peak within the budget."""

    effective_batch: int
    world_size: int
    per_rank_batch: int
    micro_size: int
    micro_batches: int
    last_micro_size: int
    budget: int
    margin: float
    predicted_peak: float
    static_bytes: int  # parameters, buffers and optimizer state
    overhead_bytes: int  # first-step runtime allocations of a fresh process
    bytes_per_sample: float
    peak_fit: Fit
    activation_fit: Fit
    probes: tuple[Probe, ...]
    checkpointing: bool
    checkpointed_blocks: tuple[str, ...]
    device: str
    seconds: float
    largest_fitting: int  # before balancing the window
    notes: tuple[str, ...] = field(default=())
    precision: str = "fp32"  # the autocast precision it was measured under
    sync: str = "window"  # the gradient sync it was measured under (DDP/FSDP2 models)
    phases: tuple[Phase, ...] = ()  # the run's other parts, measured (``plan(phases=...)``)
    batch_bytes: int = 0  # the window's input batch, held while the window trains

    @property
    def micro_sizes(self) -> list[int]:
        """Sizes of one rank's micro-batches in a window."""
        return [self.micro_size] * (self.micro_batches - 1) + [self.last_micro_size]

    @property
    def base_bytes(self) -> int:
        """What every window's peak sits on: static, first-step overhead and its batch."""
        return self.static_bytes + self.overhead_bytes + self.batch_bytes

    def predict(self, micro_size: int) -> float:
        return self.base_bytes + self.peak_fit(micro_size)

    @property
    def run_peak(self) -> float:
        """The whole run's predicted peak: the planned window's, or a phase's above it."""
        return max([self.predicted_peak, *(p.peak_bytes for p in self.phases)])

    def phase_size(self, name: str) -> int:
        """The micro-batch a phase was planned at (``micro_size`` when it was not)."""
        return next((p.micro_size for p in self.phases if p.name == name), self.micro_size)

    def apply(self, model: torch.nn.Module) -> None:
        """Put the plan's activation checkpointing on ``model`` (a no-op when it has none)."""
        if self.checkpointing:
            enable_checkpointing(model)

    def export(self, framework: str) -> Export:
        """This plan as ``framework``'s settings: "transformers", "lightning", "accelerate"
        or "deepspeed". ``.settings`` is a dict for the framework's own object (or
        DeepSpeed's config), ``.snippet`` the code or JSON to paste, ``.micro_size`` and
        ``.accumulation_steps`` the equal split, exact or refused with a ValueError."""
        return export(self, framework)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["micro_sizes"] = self.micro_sizes
        return out

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Plan:
        """The plan ``to_dict()`` gave (read back from JSON); keys it does not know are
        ignored, a missing or mistyped field raises ValueError."""
        try:
            values = {f.name: saved[f.name] for f in fields(cls) if f.name in saved}
            values["peak_fit"] = Fit(**values["peak_fit"])
            values["activation_fit"] = Fit(**values["activation_fit"])
            values["probes"] = tuple(Probe(**p) for p in values["probes"])
            values["checkpointed_blocks"] = tuple(values.get("checkpointed_blocks", ()))
            values["notes"] = tuple(values.get("notes", ()))
            values["phases"] = tuple(
                Phase(**{**p, "tried": tuple(map(tuple, p.get("tried", ())))})
                for p in values.get("phases", ())
            )
            plan = cls(**values)
            plan.summary()  # every number it shows is a number
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a saved plan: {type(err).__name__}: {err}") from None
        return plan

    def summary(self) -> str:
        sizes = self.micro_sizes
        shape = (
            f"{self.micro_batches} x {self.micro_size}"
            if self.last_micro_size == self.micro_size
            else f"{self.micro_batches - 1} x {self.micro_size} + 1 x {self.last_micro_size}"
        )
        per_rank = f" per rank ({self.world_size} ranks)" if self.world_size > 1 else ""
        windows = (
            "1 micro-batch" if self.micro_batches == 1 else f"{self.micro_batches} micro-batches"
        )
        measured = self.probes[-1] if self.probes else None
        how = f" ({measured.kind})" if measured is not None else ""
        stepped = measured is not None and measured.kind.startswith("from")
        lines = [
            f"effective batch {self.effective_batch}: {shape} = {sum(sizes)} samples{per_rank}",
            f"micro-batch {self.micro_size} (largest that fits: {self.largest_fitting}), "
            f"{windows} per window"
            + (
                f", activation checkpointing on {len(self.checkpointed_blocks)} blocks"
                if self.checkpointing
                else ""
            ),
            # predicted_peak is what the planned size peaked at, measured: the fit only
            # chose the size to measure
            f"peak {format_bytes(self.predicted_peak)} {stepped and 'predicted' or 'measured'} "
            f"at micro-batch "
            f"{self.micro_size}{how}, the fit's prediction "
            f"{format_bytes(self.predict(self.micro_size))}; budget "
            f"{format_bytes(self.budget)} ({self.margin:.0%} margin kept free) on {self.device}",
            f"static {format_bytes(self.static_bytes)} (parameters, buffers, optimizer state) + "
            f"first-step overhead {format_bytes(self.overhead_bytes)} "
            + (
                f"+ the window's batch {format_bytes(self.batch_bytes)} "
                if self.batch_bytes
                else ""
            )
            + f"{signed_bytes(self.peak_fit.intercept)} + "
            f"{format_bytes(self.bytes_per_sample)} per sample; {self.peak_fit.quality()}",
            f"activations saved for backward: {self.activation_fit.activations()}; planned in "
            f"{self.seconds:.1f} s",
            *self._phase_lines(),
            *self.notes,
        ]
        return "\n".join(lines)

    def _phase_lines(self) -> list[str]:
        """The whole run, phase by phase, and which holds the most."""
        if not self.phases:
            return []
        parts = [f"training {format_bytes(self.predicted_peak)}"]
        for p in self.phases:
            size = f" at micro-batch {p.micro_size}" if p.micro_size != self.micro_size else ""
            parts.append(f"{p.name} {format_bytes(p.peak_bytes)}{size}")
        top = max(self.phases, key=lambda p: p.peak_bytes)
        most = "training" if self.predicted_peak >= top.peak_bytes else top.name
        lines = [f"the whole run, measured: {', '.join(parts)}; {most} holds the most"]
        for p in self.phases:
            if p.tried:
                size, peak = p.tried[0]
                lines.append(
                    f"{p.name} has a micro-batch of its own, {p.micro_size}: at {size} it "
                    f"peaked at {format_bytes(peak)}, above the usable budget"
                )
        return lines

    def table(self) -> str:
        """Predicted vs measured memory per probed size (markdown), each the whole peak as
        the summary and the plot count it: the static and first-step bytes included."""
        base = self.base_bytes
        rows = [
            "| micro-batch | probe | measured peak | the line's prediction | error | activations |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for p in self.probes:
            peak, predicted = base + p.peak_bytes, base + p.predicted_bytes
            err = (predicted - peak) / peak if peak else 0.0
            rows.append(
                f"| {p.micro_size} | {p.kind} | {format_bytes(peak)} | "
                f"{format_bytes(predicted)} | {err:+.1%} | "
                f"{format_bytes(p.activation_bytes)} |"
            )
        return "\n".join(rows)


def signed_bytes(n: float) -> str:
    """``+ 1.2 MiB`` or ``- 26.3 KiB`` (never ``+ -26.3 KiB``)."""
    return f"- {format_bytes(-n)}" if n < 0 else f"+ {format_bytes(n)}"


def _fit(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    return _fit_with(xs, ys, *fit_line(xs, ys))


def _fit_with(xs: Sequence[float], ys: Sequence[float], intercept: float, slope: float) -> Fit:
    errors = [abs(intercept + slope * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0]
    return Fit(intercept=intercept, slope=slope, max_error=max(errors, default=0.0))


@one_process()  # rank 0 plans for every rank on its own, plain model
def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    loss_fn: LossFn,
    effective_batch: int,
    budget: int | str,
    world_size: int = 1,
    *,
    margin: float = 0.15,
    probe_sizes: Sequence[int] | None = None,
    checkpointing: str = "off",
    precision: str = "fp32",
    accumulate_dtype: Any = "auto",
    verify: Callable[[int, int, bool], int] | None = None,
    meter: str = "auto",
    sync: str = "window",
    phases: Mapping[str, Callable[[int], Any]] | None = None,
) -> Plan:
    """Plan the micro-batch for ``effective_batch`` samples (over all ranks) in ``budget``.

    ``sample_batch``: a batch at its largest shape (longest sequences); its samples are
    repeated when a probe needs more of them (memory depends on shapes, not values).
    ``budget``: bytes, or a string such as "2GiB" or "1500MB"; on CUDA it bounds the
    allocator's peak, on CPU the resident memory of training: parameters, buffers and
    optimizer state, plus what the process's RSS grows by while it trains. ``margin``: the
    fraction of the budget kept free for what the measurement cannot see: on CPU, fresh
    runs of the same training peak several percent apart (glibc's heap layout varies from
    process to process), so the default keeps 15% free. ``checkpointing``: "off", "on"
    (checkpoint the model's repeated blocks) or "auto" (only if nothing fits without).
    ``probe_sizes``: micro-batch sizes to measure (default 1, 2, 4, 8, capped by the
    per-rank batch). After the fit, a window at the planned size is measured too, and the
    size steps down until it fits:
    in this process by default, or by ``verify(micro_size, micro_batches, checkpointing) ->
    peak bytes``,
    which ``gradaccum plan`` points at a fresh process (where training will run, and where
    CPU memory is not shaped by the probes before it). ``meter``: "auto" (CUDA's allocator
    on a GPU, resident memory on CPU), "rss", or "tensors" (live tensor bytes: deterministic,
    blind to the allocator's own overheads).

    ``sync``: for a DDP or FSDP2 model, the gradient sync the probes run under (every rank
    calls ``plan`` together, and the fullest rank's measurements decide), or "auto": under
    FSDP2 both are measured, and ``"window"`` (one reduce-scatter per window, the whole
    unsharded gradient held between micro-batches) is chosen when it fits, else ``"micro"``
    (one per micro-batch, one shard held); the plan's notes give both predictions and why.

    ``phases``: the run's other parts, ``{"evaluation": fn, "checkpoint": fn, ...}``, each
    ``fn(micro_size)`` run in this process after the planned window (the optimizer state
    held, as in training) and measured: the plan's ``phases`` and ``run_peak`` cover the
    whole run. A phase over the usable budget at the planned micro-batch is measured again
    at half the size, and half again, and gets a micro-batch of its own
    (``plan.phase_size(name)``); one that does not fit at one sample is refused.
    """
    if sync == "auto":
        return _plan_sync(
            model,
            optimizer,
            sample_batch,
            loss_fn,
            effective_batch,
            budget,
            world_size,
            margin=margin,
            probe_sizes=probe_sizes,
            checkpointing=checkpointing,
            precision=precision,
            accumulate_dtype=accumulate_dtype,
            verify=verify,
            meter=meter,
            phases=phases,
        )
    problems: list[str] = []
    if sync not in SYNC_MODES:
        problems.append(f"sync must be one of {', '.join([*SYNC_MODES, 'auto'])}, got {sync!r}")
    for value, name in ((effective_batch, "effective_batch"), (world_size, "world_size")):
        if (problem := int_problem(value, name)) is not None:
            problems.append(problem)
    try:
        budget_bytes = parse_bytes(budget)
    except ValueError as err:
        problems.append(f"budget: {err}")
        budget_bytes = 0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        problems.append(f"margin must be a fraction in [0, 1), got {margin!r}")
    if meter not in METERS:
        problems.append(f"meter must be one of {', '.join(METERS)}, got {meter!r}")
    if checkpointing not in CHECKPOINTING:
        problems.append(
            f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}"
        )
    if not problems and effective_batch % world_size:
        problems.append(
            f"effective_batch {effective_batch} does not divide over world_size {world_size} "
            f"ranks ({effective_batch} = {world_size} x {effective_batch // world_size} + "
            f"{effective_batch % world_size}); choose a multiple of {world_size}"
        )
    sample_n = 0
    try:
        sample_n = batch_size(sample_batch)
    except (TypeError, ValueError) as err:
        problems.append(f"sample_batch: {err}")
    if problems:
        raise ValueError("cannot plan: " + "; ".join(problems))
    per_rank = effective_batch // world_size

    if sample_n == 0:
        raise ValueError("cannot plan: sample_batch holds no sample")
    if probe_sizes is None:
        probe_sizes = [s for s in (1, 2, 4, 8) if s <= max(2, per_rank)]
    else:
        probe_sizes = sorted(set(probe_sizes))
        bad = [s for s in probe_sizes if int_problem(s, "a probe size") is not None]
        if bad or len(probe_sizes) < 2:
            raise ValueError(
                f"probe_sizes must be two or more different integers >= 1, got {list(probe_sizes)}"
            )

    device = next(p for p in model.parameters()).device
    memory = MemoryMeter(device, meter)
    started = time.perf_counter()
    saved = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "checkpointing": checkpointing_enabled(model),
    }
    usable = budget_bytes * (1 - margin)
    # The window's input batch is held while it trains (``acc.step(ga.split(batch, m))``):
    # its bytes, per sample as in the sample batch, are part of the window's need.
    batch_bytes = round(_input_bytes(sample_batch) / sample_n * per_rank)
    # the probes' dropout and data order must not advance any generator
    with preserved_rng(), _heap_set_aside():
        try:
            use_ckpt = checkpointing == "on"
            while True:
                prober = _Prober(
                    model,
                    optimizer,
                    sample_batch,
                    loss_fn,
                    use_ckpt,
                    precision,
                    accumulate_dtype,
                    memory,
                    sync,
                    batch_bytes,
                )
                m = prober.measure(probe_sizes, usable)
                need, measured = m.need(1), False
                if need <= usable:
                    largest = min(per_rank, int((usable - m.need(0)) // max(m.peak_fit.slope, 1.0)))
                    largest, micro, checked = _verify(prober, m, per_rank, largest, usable, verify)
                    need, measured = m.base + checked[-1].peak_bytes, True
                    if need <= usable:
                        measured_phases = _measure_phases(
                            phases or {}, memory, m, micro, usable, budget_bytes, margin
                        )
                        break
                # Nothing fits as it is, by the line or measured at one sample per
                # micro-batch: with "auto", try recomputing activations before refusing.
                if checkpointing != "auto" or use_ckpt:
                    raise ValueError(
                        too_small(model, budget_bytes, margin, use_ckpt, need, measured)
                    )
                use_ckpt = True
                _restore(model, optimizer, saved)
        finally:
            _restore(model, optimizer, saved)
    measured_peak = need

    micro_batches = math.ceil(per_rank / micro)
    last = per_rank - (micro_batches - 1) * micro
    notes = list(m.notes)
    if m.peak_fit.max_error > 0.05 and not m.peak_fit.bound:
        notes.append(
            f"note: the memory fit is off by up to {m.peak_fit.max_error:.0%} on the probes; "
            "the planned size was measured directly"
        )
    return Plan(
        effective_batch=effective_batch,
        world_size=world_size,
        per_rank_batch=per_rank,
        micro_size=micro,
        micro_batches=micro_batches,
        last_micro_size=last,
        budget=budget_bytes,
        margin=float(margin),
        # what training will peak at is what the planned size peaked at, measured as it
        # will run; the fit only chose the size to measure
        predicted_peak=measured_peak,
        static_bytes=m.static,
        overhead_bytes=m.overhead,
        batch_bytes=m.batch,
        bytes_per_sample=m.peak_fit.slope,
        peak_fit=m.peak_fit,
        activation_fit=m.activation_fit,
        probes=m.probes + checked,
        checkpointing=bool(m.blocks),
        checkpointed_blocks=m.blocks,
        device=str(device),
        seconds=time.perf_counter() - started,
        largest_fitting=largest,
        notes=tuple(notes),
        precision=precision,
        sync=sync,
        phases=measured_phases,
    )


def _plan_sync(model, optimizer, sample_batch, loss_fn, effective_batch, budget, world_size, **kw):
    """``plan(sync="auto")``: under FSDP2, both sync modes measured; "window" when it fits."""
    args = (model, optimizer, sample_batch, loss_fn, effective_batch, budget, world_size)
    if not is_sharded(model):  # DDP holds the whole gradient either way
        return plan(*args, **kw)
    plans: dict[str, Plan | ValueError] = {}
    for mode in SYNC_MODES:
        try:
            plans[mode] = plan(*args, sync=mode, **kw)
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
    prober: _Prober,
    m: _Measured,
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
    the scaled line is measured next; in a fresh process, planned by the scaled line, so a
    plan starts one process at most. Returns the sizes' probes, the deciding one last.
    """
    checked: list[Probe] = []
    for _ in range(8):
        micro = math.ceil(per_rank / math.ceil(per_rank / largest))  # balanced window
        n = min(math.ceil(per_rank / micro), 2)
        act = int(m.activation_fit(micro))
        if verify is not None:
            peak = int(verify(micro, n, bool(m.blocks))) - m.static - m.overhead
            kind = "verify, fresh process"
        else:
            # The planned window, twice, keeping the larger peak: on CPU, RSS grows over
            # the first windows as malloc's free lists fragment.
            peak, act = max(prober.window(micro, micro_batches=n)[:2] for _ in range(2))
            kind = "verify"
        verified = Probe(micro, peak, act, m.peak_fit(micro), kind=kind)
        checked.append(verified)
        if m.base + peak <= usable or micro == 1:
            return largest, micro, tuple(checked)
        # the line scaled to pass through this measurement (never below it)
        scale = max(1.0, peak / max(m.peak_fit(micro), 1.0))
        fits = [s for s in range(1, micro) if m.base + scale * m.peak_fit(s) <= usable]
        largest = fits[-1] if fits else 1
        if verify is not None and fits:
            # A fresh process sits above the probes' line by what a process pays once (its
            # allocator's first blocks, the evaluation's) and, with glibc as it comes, by a
            # steeper slope: the scaled line reads the measured size exactly and the sizes
            # below it within a few percent either way (bench/results/planner.md), so the
            # size it fits is planned without a second process.
            micro = math.ceil(per_rank / math.ceil(per_rank / largest))
            stepped = Probe(
                micro,
                int(scale * m.peak_fit(micro)),
                int(m.activation_fit(micro)),
                m.peak_fit(micro),
                kind=f"from the fresh process's {verified.micro_size}, the line scaled",
            )
            return largest, micro, (*checked, stepped)
    return largest, micro, tuple(checked)


def _measure_phases(
    phases: Mapping[str, Callable[[int], Any]],
    memory: MemoryMeter,
    m: _Measured,
    micro: int,
    usable: float,
    budget: int,
    margin: float,
) -> tuple[Phase, ...]:
    """Each of the run's other parts, measured after the planned window; one over the usable
    budget is measured again at half the micro-batch until it fits."""
    out = []
    for name, run in phases.items():
        size, tried = micro, []
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


@dataclass(frozen=True)
class _Measured:
    static: int
    overhead: int
    peak_fit: Fit
    activation_fit: Fit
    probes: tuple[Probe, ...]
    blocks: tuple[str, ...]
    notes: tuple[str, ...] = ()
    batch: int = 0  # the window's input batch

    def need(self, micro_size: int) -> float:
        """Predicted peak for ``micro_size`` (0: the part that does not grow with it)."""
        return self.base + self.peak_fit(micro_size)

    @property
    def base(self) -> int:
        """What the window's peak sits on: static, first-step overhead and its batch."""
        return self.static + self.overhead + self.batch


class _Prober:
    """Runs measured windows through a real Accumulator on the user's model."""

    def __init__(
        self,
        model,
        optimizer,
        sample_batch,
        loss_fn,
        use_ckpt,
        precision,
        accumulate_dtype,
        meter,
        sync="window",
        batch_bytes=0,
    ) -> None:
        self.batch_bytes = batch_bytes
        self.blocks = enable_checkpointing(model) if use_ckpt else []
        self.model, self.optimizer = model, optimizer
        self.sample_batch, self.loss_fn, self.meter = sample_batch, loss_fn, meter
        self.acc = Accumulator(
            model,
            optimizer,
            precision=Precision(precision, accumulate_dtype=accumulate_dtype),
            sync=sync,
        )

    def window(self, size: int, micro_batches: int = 2) -> tuple[int, int, bool]:
        """Peak memory of a window of micro-batches of ``size`` above its start, and the
        activation bytes one micro-batch saves for backward, and whether the optimizer stepped.
        From the second micro-batch on, the first one's gradients are held, as in training."""
        micro = take(self.sample_batch, size)
        self.meter.start()
        try:
            for i in range(micro_batches):
                with self.acc.micro_batch(last=i == micro_batches - 1):
                    if i == 0:
                        with saved_activation_bytes(self.model) as act:
                            loss_sum, count = self.loss_fn(self.model, micro)
                    else:
                        loss_sum, count = self.loss_fn(self.model, micro)
                    self.acc.backward(loss_sum, count)
            stepped = self.acc.end_window().stepped
        except BaseException:
            self.meter.stop()
            raise
        peak, saved = self.meter.peak(), act[0]
        if self.acc.sync.distributed:  # the fullest rank's numbers, so every rank decides alike
            peak, saved = self.acc.sync.most([peak, saved])
        return peak, saved, stepped

    def measure(self, probe_sizes: Sequence[int], usable: float | None = None) -> _Measured:
        """Warm up, then probe ``probe_sizes`` in order, stopping once the line through the
        probes so far puts the next size above ``usable`` bytes."""
        state_before = tensor_bytes(self.optimizer.state_dict()["state"])
        # The warm-up allocates the optimizer state and lazy buffers. Under fp16 its first
        # windows may overflow and skip the step (GradScaler lowers its scale each time):
        # warm up until a real step has allocated the state, or the static term leaves it out.
        for _ in range(_WARMUP_WINDOWS):
            warm_peak, _, stepped = self.window(probe_sizes[0])
            if stepped:
                break
        else:
            raise ValueError(
                f"the optimizer never stepped in {_WARMUP_WINDOWS} warm-up windows (every one "
                "was skipped: a non-finite gradient); the model cannot be planned like this"
            )
        state_after = tensor_bytes(self.optimizer.state_dict()["state"])
        static = (
            tensor_bytes(list(self.model.parameters()))
            + tensor_bytes(list(self.model.buffers()))
            + state_after
        )
        measured: list[tuple[int, int, int]] = []
        growth = state_after - state_before
        for i, size in enumerate(probe_sizes):
            try:
                # twice, keeping the larger peak: on CPU, RSS grows over the first windows as
                # malloc's free lists fragment, as the verify step below does too
                measured.append((size, *max(self.window(size)[:2] for _ in range(2))))
            except torch.OutOfMemoryError:
                self.acc.abort_window()
                break  # a real device ran out: larger probes would too
            nxt = probe_sizes[i + 1] if i + 1 < len(probe_sizes) else None
            if nxt is not None and len(measured) >= 2 and usable is not None:
                m = self._fitted(static, warm_peak, growth, probe_sizes[0], measured)
                if m.need(nxt) > usable:
                    # A larger probe cannot be the plan, and on a GPU it would run out: the
                    # line through these decides.
                    skipped = [s for s in probe_sizes if s >= nxt]
                    note = (
                        f"note: probes stopped at micro-batch {size}: the line predicts "
                        f"{format_bytes(m.need(nxt))} for {nxt}, above the usable budget "
                        f"(not probed: {', '.join(map(str, skipped))})"
                    )
                    return replace(m, notes=(*m.notes, note))
        if len(measured) < 2:
            raise torch.OutOfMemoryError(
                f"only {len(measured)} probe size fit on {self.meter.device} (sizes "
                f"{list(probe_sizes)}); two are needed to fit the memory model"
            )
        return self._fitted(static, warm_peak, growth, probe_sizes[0], measured)

    def _fitted(
        self,
        static: int,
        warm_peak: int,
        growth: int,
        first_size: int,
        measured: list[tuple[int, int, int]],
    ) -> _Measured:
        """The memory model through the probes measured so far."""
        xs = [m[0] for m in measured]
        peak_fit = _fit(xs, [m[1] for m in measured])
        act_fit = _fit(xs, [m[2] for m in measured])
        notes = []
        if peak_fit.slope < act_fit.slope:
            # Peak memory grows at least by what a sample saves for backward. Below that (a
            # small model on CPU, where the allocator's page reuse is noise at this size),
            # take the activations' slope and the lowest line above every measured peak.
            slope = act_fit.slope
            peaks = [m[1] for m in measured]
            intercept = max(y - slope * x for x, y in zip(xs, peaks, strict=True))
            peak_fit = replace(_fit_with(xs, peaks, intercept, slope), bound=True)
            notes.append(
                "note: peak memory did not grow measurably with the micro-batch (allocator "
                "noise at this size); per-sample bytes are the saved activations'"
            )
        # What the first step of a fresh process allocates beyond its share (thread pools,
        # kernel workspaces): in a training run it is paid once, at the top of the peak.
        overhead = max(0, int(warm_peak - growth - peak_fit(first_size)))
        probes = tuple(Probe(s, pk, a, peak_fit(s)) for s, pk, a in measured)
        return _Measured(
            static, overhead, peak_fit, act_fit, probes, tuple(self.blocks), tuple(notes),
            batch=self.batch_bytes,
        )  # fmt: skip
