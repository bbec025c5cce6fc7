"""What a plan is: ``Plan`` (the window to run, its memory and how it was measured), the
line through the probes (``Fit``), each measured window (``Probe``) and each of the run's
other parts (``Phase``). Plain records: saved as JSON by the command, read back whole."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from gradaccum.memory import format_bytes
from gradaccum.planning.exports import Export, export
from gradaccum.planning.speed import Timing
from gradaccum.recompute import enable_checkpointing

__all__ = [
    "TIMING_HEAD", "Fit", "Phase", "Plan", "Probe", "format_seconds", "line_error", "signed_bytes",
]  # fmt: skip

# the note summary() writes from the numbers; plans saved before it carry it in their notes
_FIT_NOTE = "note: the memory fit is off by up to "
# the timing table's columns (the console's markdown and the report's page)
TIMING_HEAD = (
    "micro-batch", "window", "activation checkpointing", "predicted peak",
    "s per effective batch: median [range]", "ms per sample", "windows", "",
)  # fmt: skip


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
            why = (
                f"it misses a probe by {self.max_error:.0%}"
                if self.max_error > 1.0
                else "the peak does not grow with the micro-batch"
            )
            return (
                f"no plausible line ({why}): the peak measured at the planned size is what counts"
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
    # process's N, the line scaled": the line through a measurement over the budget;
    # STEPPED_UP: a size between a fresh measurement that fits and one that did not
    kind: str = "fit"


# The kind of a fresh measurement read between a fitting one and the smallest over it (its
# peak: the larger of the measurement and the line through the two).
STEPPED_UP = "verify, fresh process, on the line through two fresh measurements"


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
    # prefer="fastest": each candidate size's timed windows, and why the size was chosen
    prefer: str = "largest"
    timings: tuple[Timing, ...] = ()
    choice: str = ""
    timing_seconds: float = 0.0  # of ``seconds``, what timing the sizes took

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
            # the fit's note is said from the numbers now (an older plan saved its words)
            values["notes"] = tuple(
                n for n in values.get("notes", ()) if not str(n).startswith(_FIT_NOTE)
            )
            values["timings"] = tuple(
                Timing(**{**t, "seconds": tuple(t["seconds"])}) for t in values.get("timings", ())
            )
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
        if measured is not None and measured.micro_size != self.micro_size:
            # chosen by time below the size measured to fit
            stepped = True
            how = (
                f" (the line, plus what the measurement at {measured.micro_size} sat above it: "
                f"{format_bytes(self.base_bytes + measured.peak_bytes)} there)"
            )
        lines = [
            f"effective batch {self.effective_batch}: {shape} = {sum(sizes)} samples{per_rank}",
            f"micro-batch {self.micro_size} ({self.reason()}), {windows} per window"
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
            f"{format_seconds(self.seconds)}",
            *self._phase_lines(),
            *self._timing_lines(),
            *self.remarks(),
        ]
        return "\n".join(lines)

    def remarks(self) -> list[str]:
        """The summary's closing lines, which the report shows too: a measurement over the
        usable budget and what was planned instead, the memory line's error and how the size
        was found despite it, then the plan's notes."""
        return [*self._stepped_lines(), *self._fit_note(), *self.notes]

    def reason(self) -> str:
        """Why the micro-batch is ``micro_size``, in the words the summary and the report
        both use: the race's choice, else the largest that fits (and the balanced window)."""
        if self.choice:
            return self.choice
        if self.micro_size == self.largest_fitting:
            return "the largest that fits"
        return (
            f"the largest that fits is {self.largest_fitting}; {self.micro_size} evens out the "
            f"{self.micro_batches} micro-batches of the per-rank batch {self.per_rank_batch}"
        )

    def timing_spent(self) -> str:
        """What timing the sizes took of the planning, as the summary and the report say it."""
        return (
            f"the timing took {format_seconds(self.timing_seconds)} of the "
            f"{format_seconds(self.seconds)}"
        )

    def _stepped_lines(self) -> list[str]:
        """A measurement over the usable budget, and what the plan did instead: why "the
        largest that fits" is below a size that was measured."""
        usable = self.budget * (1 - self.margin)
        over = [
            p
            for p in self.probes
            if p.kind.startswith("verify") and self.base_bytes + p.peak_bytes > usable
        ]
        if not over:
            return []
        said = ", ".join(
            f"{p.micro_size} measured {format_bytes(self.base_bytes + p.peak_bytes)}"
            + (" in a fresh process" if "fresh" in p.kind else "")
            for p in over
        )
        last = self.probes[-1]
        if last.kind.startswith("from"):
            then = f"{self.largest_fitting} is the largest the line scaled through it fits"
            if last.micro_size != self.largest_fitting:
                then += f" ({last.micro_size} evens the window)"
        elif last.kind == STEPPED_UP:
            then = (
                f"{self.probes[-2].micro_size} was measured next and fits; {last.micro_size}, "
                "read between them on the line through both, measured and fits too"
            )
        elif over[-1].kind == STEPPED_UP:
            then = (
                f"{last.micro_size} was measured next and fits ({over[-1].micro_size}, read "
                "between them on the line through both, did not)"
            )
        else:
            then = f"{last.micro_size} was measured next"
        return [f"{said}, over the {format_bytes(usable)} usable: {then}"]

    def _fit_note(self) -> list[str]:
        """How far off the memory line is, and how the planned size was found despite it."""
        fit = self.peak_fit
        if fit.max_error <= 0.05 or fit.bound or not self.probes:
            return []
        last = self.probes[-1]
        if last.kind.startswith("from") and len(self.probes) > 1:
            how = (
                "the planned size is the line scaled through the fresh process's measurement "
                f"at {self.probes[-2].micro_size}"
            )
        elif last.micro_size != self.micro_size:
            how = (
                f"the planned size is the line plus what the measurement at {last.micro_size} "
                "sat above it"
            )
        else:
            how = "the planned size was measured directly"
        return [f"{_FIT_NOTE}{fit.max_error:.0%} on the probes; {how}"]

    def timing(self, micro_size: int) -> Timing | None:
        """The timed windows of ``micro_size`` (None: not timed)."""
        return next((t for t in self.timings if t.micro_size == micro_size), None)

    def _timing_lines(self) -> list[str]:
        """The time the chosen size takes, and what accumulation costs against one
        micro-batch of the whole per-rank batch (the seed's trade as a number)."""
        chosen = self.timing(self.micro_size)
        if chosen is None or not chosen.seconds:
            return []
        per = self.per_rank_batch
        line = (
            f"{chosen.median:.3g} s per effective batch at micro-batch {self.micro_size} "
            f"({chosen.per_sample(per) * 1e3:.3g} ms per sample), timed over "
            f"{len(chosen.seconds)} window{'s' if len(chosen.seconds) != 1 else ''}"
            + (f" of {chosen.samples} samples, scaled to {per}" if chosen.samples < per else "")
            + f" ({self.timing_spent()})"
        )
        whole = self.timing(per)
        if whole is not None and per != self.micro_size:
            line += (
                f"; accumulation takes {chosen.median / whole.median:.2f}x the time of one "
                f"micro-batch of the whole {per}"
                + (
                    " (with activation checkpointing: it fits only so)"
                    if whole.checkpointed and not chosen.checkpointed
                    else ""
                )
            )
        elif whole is None and self.largest_fitting < per:
            line += (
                f"; one micro-batch of the whole {per} does not fit: accumulation is what runs it"
            )
        return [line]

    def timing_table(self) -> str:
        """Each timed size's memory and seconds per effective batch (markdown); a size timed
        with activation checkpointing (it fits only with it) says so."""
        rows = [
            "| " + " | ".join(TIMING_HEAD) + " |",
            "|---:|---|---|---:|---:|---:|---:|---|",
        ]
        rows += ["| " + " | ".join(row) + " |" for row in self.timing_rows()]
        return "\n".join(rows)

    def timing_rows(self) -> list[list[str]]:
        """The timing table's rows (``TIMING_HEAD``'s columns), rounded as the console
        rounds them; the report shows the same cells."""
        per = self.per_rank_batch
        rows = []
        for t in self.timings:
            shape = (
                f"{t.micro_batches} x {t.micro_size}"
                if t.last_micro_size == t.micro_size
                else f"{t.micro_batches - 1} x {t.micro_size} + {t.last_micro_size}"
            )
            mark = "chosen" if t.micro_size == self.micro_size else ""
            if t.left is not None:
                mark = f"left the race after round {t.left}: slower"
            timed = (
                [f"{t.median:.3g} [{t.low:.3g}, {t.high:.3g}]", f"{t.per_sample(per) * 1e3:.3g}"]
                if t.seconds
                else ["untimed", ""]
            )
            rows.append(
                [
                    str(t.micro_size),
                    shape,
                    "on" if t.checkpointed else "off",
                    format_bytes(t.peak_bytes),
                    *timed,
                    str(len(t.seconds)),
                    mark,
                ]
            )
        return rows

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
            "| micro-batch | probe | measured peak | the line's prediction | fit error (of the "
            "peak above the base) | activations |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for p in self.probes:
            peak, predicted = base + p.peak_bytes, base + p.predicted_bytes
            err = line_error(p.peak_bytes, p.predicted_bytes)
            rows.append(
                f"| {p.micro_size} | {p.kind} | {format_bytes(peak)} | "
                f"{format_bytes(predicted)} | {err:+.1%} | "
                f"{format_bytes(p.activation_bytes)} |"
            )
        return "\n".join(rows)


def line_error(peak: float, predicted: float) -> float:
    """The line's error at a probe as ``Fit.max_error`` counts it (its largest |value| over
    the fit's probes): against the peak above the base, the part the line predicts."""
    return (predicted - peak) / peak if peak > 0 else 0.0


def format_seconds(s: float) -> str:
    """A duration as the console and the report both write it: 2.9 s, 37 min 13 s,
    1 h 02 min."""
    if s < 60:
        return f"{s:.1f} s"
    minutes, sec = divmod(round(s), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def signed_bytes(n: float) -> str:
    """``+ 1.2 MiB`` or ``- 26.3 KiB`` (never ``+ -26.3 KiB``)."""
    return f"- {format_bytes(-n)}" if n < 0 else f"+ {format_bytes(n)}"
