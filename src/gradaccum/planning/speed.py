"""The fastest micro-batch among those that fit: each candidate's seconds per effective
batch, timed over real windows taking turns, stopped as soon as the order is clear.

Accumulation trades memory for time: a window of N micro-batches keeps one micro-batch's
activations and pays N forwards and backwards. Whether larger micro-batches are faster
depends on the device and the model (a GPU's kernels fill up with the batch; on a CPU a
smaller working set can be the faster one), so it is measured, not assumed. The candidates
take turns round by round (ABBA), so what the machine does meanwhile falls on all of them
alike, and each is compared with the others round by round (paired ratios). A candidate
slower than the best beyond the noise (``slower``) leaves the race; the race ends when one
is left, or its time is spent. The largest that fits stays the choice unless another is
faster than it beyond the noise.

Where activation checkpointing lets a larger size fit (``plan(checkpointing="auto")``), that
size races too, its windows recomputing activations; it is told apart by its size (larger
than any that fits without), and the largest that fits without checkpointing stays the
default. Measuring that size's line, racing it and verifying it all come out of the same
half of the planning time: ``Extra`` estimates them from the first line's measured windows
(``WindowCost``) before any is spent, and the plan races checkpointing only when they fit.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from gradaccum.stats import fit_line

__all__ = [
    "PREFER",
    "RECOMPUTE",
    "TIE",
    "Extra",
    "Race",
    "Timing",
    "WindowCost",
    "candidates",
    "choose",
    "race",
    "slower",
    "slower_every_round",
    "window_sizes",
    "without_checkpointed",
]

PREFER = ("fastest", "largest")

# A candidate is slower than another when it is, round by round, by more than TIE (what
# a machine's noise moves one window against the next in the same round) and beyond the
# rounds' spread: a one-sided t-test at 1% on the paired log-ratios (_T99: the t quantile
# by degrees of freedom).
TIE = 0.03
_MIN_ROUNDS = 3
_MAX_ROUNDS = 9
_T99 = {2: 6.965, 3: 4.541, 4: 3.747, 5: 3.365, 6: 3.143, 7: 2.998, 8: 2.896}

# What a checkpointed window costs against the same window without: a backward is about two
# forwards, and recomputation runs each block's forward once more, so three passes become
# four at most (the layers outside the blocks are not recomputed).
RECOMPUTE = 4 / 3


def window_sizes(samples: int, micro_size: int) -> list[int]:
    """The micro-batches of a window of ``samples`` at ``micro_size``: equal, the last one
    smaller where they do not divide (the effective batch exact)."""
    n = math.ceil(samples / micro_size)
    return [micro_size] * (n - 1) + [samples - (n - 1) * micro_size]


def candidates(per_rank: int, largest: int) -> list[int]:
    """The sizes worth timing, largest first: the largest that fits, the largest divisor of
    the per-rank batch from it down to half of it (what a framework's equal micro-batches
    use), and about half and a quarter of the largest (a divisor of the per-rank batch where
    one is near). Not every size: time per sample changes slowly with the size,
    and each candidate costs whole windows."""
    largest = max(1, min(largest, per_rank))

    def near(target: float, lowest: float) -> int:
        """The largest divisor of the per-rank batch from ``target`` down to ``lowest``, or
        ``target`` rounded down."""
        top = max(1, int(target))
        for d in range(top, max(1, math.ceil(lowest)) - 1, -1):
            if per_rank % d == 0:
                return d
        return top

    out = [largest, near(largest, largest / 2)]
    for part in (2, 4):
        out.append(near(largest / part, largest / part * 2 / 3))
    return sorted(set(out), reverse=True)


@dataclass(frozen=True)
class WindowCost:
    """Seconds of a window, as a line fitted through measured ones: ``per_micro_batch`` (what
    each micro-batch pays whatever its size: Python, kernel launches, a host round trip)
    plus ``per_sample`` times its samples; a checkpointed window costs ``RECOMPUTE`` times
    the same window without."""

    per_micro_batch: float
    per_sample: float

    @classmethod
    def fit(cls, windows: Sequence[tuple[int, int, float]]) -> WindowCost:
        """Through ``(micro_size, micro_batches, seconds)`` measured windows: a micro-batch's
        seconds against its size, by least squares, neither term below zero (one size
        measured, or a line through the origin's wrong side: all of it per sample)."""
        if not windows:
            raise ValueError("a window cost needs at least one measured window, got none")
        xs = [float(size) for size, _, _ in windows]
        ys = [seconds / n for _, n, seconds in windows]
        if len(set(xs)) > 1:
            intercept, slope = fit_line(xs, ys)
            if slope < 0:  # no dearer per sample than the mean micro-batch
                return cls(per_micro_batch=statistics.fmean(ys), per_sample=0.0)
            if intercept >= 0:
                return cls(per_micro_batch=intercept, per_sample=slope)
        return cls(per_micro_batch=0.0, per_sample=sum(ys) / sum(xs))

    def __call__(self, micro_sizes: Sequence[int], checkpointed: bool = False) -> float:
        """Seconds of a window of ``micro_sizes``."""
        plain = len(micro_sizes) * self.per_micro_batch + sum(micro_sizes) * self.per_sample
        return plain * (RECOMPUTE if checkpointed else 1.0)


@dataclass(frozen=True)
class Extra:
    """What racing the size only checkpointing fits adds to a plan, in seconds, against what
    it may add: ``allowed``, half of what the plan took before (planning grows by half at
    most). ``line``: the checkpointed line's probes and its verification in this process;
    ``race``: the least race that can choose it (a first window of every size, then three
    rounds, each window of the checkpointed size's samples at least); ``fresh``: its
    verification in a fresh process, where training runs, should it win (0: no ``verify``).
    Estimates, made before any of it is spent; ``fresh`` is held back from the race."""

    allowed: float
    line: float
    race: float
    fresh: float

    @classmethod
    def estimate(
        cls,
        allowed: float,
        cost: WindowCost,
        fresh: float,
        *,
        probe_sizes: Sequence[int],
        sizes: Sequence[int],
        per_rank: int,
    ) -> Extra:
        """From the first line's windows (``cost``) and its fresh-process verification's
        seconds (``fresh``): the checkpointed line probes ``probe_sizes`` as the first did
        (a warm-up window, then two windows of two micro-batches each) and verifies its
        size twice; the race times ``sizes`` (without checkpointing) against it. Its size is
        not known before its line is measured: taken as the per-rank batch, the most it can
        be, so the estimate is the dearest."""
        top = per_rank  # the checkpointed size, at most
        probes = [[probe_sizes[0]] * 2] + [[s] * 2 for s in probe_sizes for _ in range(2)]
        # two verification windows at the dearest size it may verify: balanced (the per-rank
        # batch over a whole number of micro-batches), larger than every size raced without
        # it, two micro-batches at most
        balanced = {math.ceil(per_rank / k) for k in range(1, per_rank + 1)}
        above = [m for m in balanced if m > max(sizes, default=0)]
        dearest = max(
            ([m] * min(math.ceil(per_rank / m), 2) for m in above),
            key=lambda w: cost(w, checkpointed=True),
            default=[top],
        )
        verification = [dearest] * 2
        line = sum(cost(w, checkpointed=True) for w in probes + verification)
        race_sizes = [(m, False) for m in sizes if m < top] + [(top, True)]
        first = sum(cost([m, *([per_rank % m] if per_rank % m else [])], c) for m, c in race_sizes)
        rounds = sum(cost(window_sizes(top, m), c) for m, c in race_sizes)
        return cls(allowed, line, first + _MIN_ROUNDS * rounds, fresh)

    @property
    def affordable(self) -> bool:
        return self.line + self.race + self.fresh <= self.allowed

    def race_budget(self, line_spent: float) -> float:
        """What the race may take once the line took ``line_spent``: the rest of ``allowed``,
        less the fresh verification held back for a checkpointed winner."""
        return self.allowed - line_spent - self.fresh

    def why_not(self) -> str:
        fresh = (
            f" and its verification in a fresh process (about {self.fresh:.1f} s)"
            if self.fresh
            else ""
        )
        return (
            "activation checkpointing not raced: measuring its line in this process (about "
            f"{self.line:.1f} s), a race that can choose it (about {self.race:.1f} s){fresh} "
            f"would take more than the {self.allowed:.1f} s planning may add (half of what "
            "it took without them)"
        )


@dataclass(frozen=True)
class Timing:
    """One candidate's timed windows: ``seconds``, each round's seconds per effective batch
    (of ``samples`` samples timed, scaled to the per-rank batch when fewer); ``left``: the
    round after which it left the race as clearly slower (None: it ran to the end);
    ``peak_bytes``: the peak the plan predicts at this size; ``checkpointed``: timed with
    activation checkpointing (the size fits only with it)."""

    micro_size: int
    micro_batches: int
    last_micro_size: int
    samples: int
    seconds: tuple[float, ...]
    peak_bytes: float = 0.0
    left: int | None = None
    checkpointed: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else math.nan

    @property
    def low(self) -> float:
        return min(self.seconds, default=math.nan)

    @property
    def high(self) -> float:
        return max(self.seconds, default=math.nan)

    def per_sample(self, per_rank: int) -> float:
        return self.median / per_rank


@dataclass(frozen=True)
class Race:
    """What the race found: every candidate's ``timings``, the ``fastest`` by median, the
    ``chosen`` size and ``why`` in one line. ``spent``: its seconds."""

    timings: tuple[Timing, ...]
    fastest: int
    chosen: int
    why: str
    spent: float


def _ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Round by round, a's seconds over b's, over the rounds both ran."""
    return [x / y for x, y in zip(a, b, strict=False) if y > 0]


def slower(a: Sequence[float], b: Sequence[float], tie: float = TIE) -> bool:
    """Whether ``a`` is slower than ``b`` beyond the noise, over the rounds both ran (three
    at least): the mean of the paired log-ratios above ``log(1 + tie)``, and above zero by
    a one-sided t-test at 1% (the test is repeated as rounds come in: a strict level keeps
    the chance that noise alone decides small)."""
    logs = [math.log(x) for x in _ratios(a, b) if x > 0]
    n = len(logs)
    if n < _MIN_ROUNDS:
        return False
    mean = statistics.fmean(logs)
    if mean <= math.log1p(tie):
        return False
    spread = statistics.stdev(logs) / math.sqrt(n)
    return spread == 0 or mean / spread > _T99[min(n - 1, max(_T99))]


def slower_every_round(a: Sequence[float], b: Sequence[float], tie: float = TIE) -> bool:
    """Whether ``a`` is slower than ``b`` in every round both ran (three at least), by more
    than ``tie`` in the median round: the test that lets the choice leave the largest. Less
    strict than ``slower``, which ends a size's race: leaving the largest for a size that is
    in truth as fast costs nothing, while ending the race of the size that is in truth the
    fastest loses it. (Three rounds of a window each, all that planning's half allows for
    larger models, give ``slower`` 2 degrees of freedom: a gap of 4% in every round, as
    steady as 1-2%, does not pass it.)"""
    ratios = _ratios(a, b)
    return (
        len(ratios) >= _MIN_ROUNDS and min(ratios) > 1.0 and (statistics.median(ratios) > 1.0 + tie)
    )


def choose(
    seconds: dict[int, list[float]],
    tie: float = TIE,
    *,
    checkpointed: Collection[int] = (),
) -> tuple[int, int, str]:
    """(chosen, fastest, why) from each size's seconds per effective batch, round by round:
    the fastest by median when the default is slower than it beyond the noise (``slower``,
    or ``slower_every_round``),
    else the default: the largest size, or with ``checkpointed`` sizes (those timed with
    activation checkpointing) the largest of the others."""
    plain = [m for m in seconds if m not in checkpointed]
    default = max(plain or seconds)
    mixed = bool(plain) and len(plain) < len(seconds)  # some timed with checkpointing
    largest = "the largest that fits" + (" without checkpointing" if mixed else "")
    fastest = min(seconds, key=lambda m: statistics.median(seconds[m]))
    n = len(seconds)
    if fastest == default:
        return default, fastest, f"the fastest of {n} sizes timed, {largest}"
    if slower(seconds[default], seconds[fastest], tie) or slower_every_round(
        seconds[default], seconds[fastest], tie
    ):
        gain = statistics.median(_ratios(seconds[default], seconds[fastest]))
        how = ", with activation checkpointing" if mixed and fastest in checkpointed else ""
        return (
            fastest,
            fastest,
            (
                f"the fastest of {n} sizes timed{how}: {gain:.2f}x faster per effective batch "
                f"than {largest}, {default}"
            ),
        )
    ratios = _ratios(seconds[default], seconds[fastest])
    rounds = len(ratios)
    each = f"{rounds} window{'s' if rounds > 1 else ''} each"
    if rounds < _MIN_ROUNDS:
        each += " in the time planning allows"
    other = f"{fastest}{' checkpointed' if mixed and fastest in checkpointed else ''}"
    said = f"{largest}; timing cannot tell it from {other} beyond the noise ({each})"
    if ratios:  # what the machine's noise did: the gap, and how far the rounds moved it
        gap = statistics.median(ratios) - 1.0
        said += (
            f": {other} was {gap:.1%} faster in the median round, {min(ratios) - 1.0:+.1%} "
            f"to {max(ratios) - 1.0:+.1%} round by round"
        )
        if gap > tie:  # the noise decided: the choice may be slower than the tie says
            said += f", so {default} may be up to {gap:.0%} slower (the tie is {tie:.0%})"
    return default, fastest, said


def race(
    window: Callable[[list[int], bool], float],
    sizes: Sequence[int],
    per_rank: int,
    budget_s: float,
    *,
    checkpointed: Collection[int] = (),
    max_rounds: int = _MAX_ROUNDS,
    tie: float = TIE,
) -> Race:
    """Time ``sizes`` and choose. ``window(micro_sizes, checkpointed) -> seconds`` runs one
    real window of those micro-batches, with activation checkpointing for the sizes in
    ``checkpointed`` (all of them, or some each larger than every other size: what fits
    only with it). First a
    short window of each (one micro-batch, and the ragged last one where there is one: the
    shapes' one-time costs, and the cost per sample); then rounds of a window each, taking
    turns (in order, then reversed), of the whole per-rank batch, or of fewer samples when
    three rounds of the whole would not fit ``budget_s`` (scaled up to the per-rank batch).
    A candidate slower than the fastest so far beyond the noise leaves the race. The
    largest (without checkpointing, where some are checkpointed) is chosen unless another
    is faster than it beyond the noise."""
    began = time.perf_counter()
    sizes = sorted(set(sizes), reverse=True)
    checkpointed = frozenset(m for m in checkpointed if m in sizes)
    plain = [m for m in sizes if m not in checkpointed]
    if plain and checkpointed and min(checkpointed) < plain[0]:
        raise ValueError(
            f"checkpointed sizes {sorted(checkpointed)} must be larger than every size timed "
            f"without checkpointing, the largest of which is {plain[0]}"
        )
    default = plain[0] if plain else sizes[0]
    per_sample = {}
    for m in sizes:
        warm = [m]
        if per_rank % m:  # the real window's ragged last micro-batch, warmed too
            warm.append(per_rank % m)
        per_sample[m] = window(warm, m in checkpointed) / sum(warm)
    left_s = budget_s - (time.perf_counter() - began)
    # one round of every candidate at the whole per-rank batch, as far as the budget goes
    round_cost = sum(per_sample.values()) * per_rank
    samples = per_rank
    if _MIN_ROUNDS * round_cost > left_s:
        samples = max(sizes[0], int(left_s / (_MIN_ROUNDS * sum(per_sample.values()))))
        samples = min(per_rank, samples)
    seconds: dict[int, list[float]] = {m: [] for m in sizes}
    left: dict[int, int | None] = dict.fromkeys(sizes)
    alive = list(sizes)
    for r in range(max_rounds):
        # no round that would end past the budget, the first one included
        cost = sum(
            statistics.median(seconds[m]) * samples / per_rank if seconds[m] else
            per_sample[m] * samples
            for m in alive
        )  # fmt: skip
        if time.perf_counter() - began + cost > budget_s:
            break
        for m in alive if r % 2 == 0 else alive[::-1]:
            spent = window(window_sizes(samples, m), m in checkpointed)
            seconds[m].append(spent * per_rank / samples)
        if r + 1 >= _MIN_ROUNDS:
            best = min(alive, key=lambda m: statistics.median(seconds[m]))
            for m in list(alive):
                if m != best and slower(seconds[m], seconds[best], tie):
                    alive.remove(m)
                    left[m] = r + 1
        if len(alive) == 1:
            break
    if seconds[default]:
        chosen, fastest, why = choose(seconds, tie, checkpointed=checkpointed)
    else:
        chosen = fastest = default
        why = (
            "the largest that fits"
            + (" without checkpointing" if plain and checkpointed else "")
            + "; no window of the others fit in the time planning allows"
        )

    timings = tuple(
        Timing(
            micro_size=m,
            micro_batches=math.ceil(per_rank / m),
            last_micro_size=window_sizes(per_rank, m)[-1],
            samples=samples,
            seconds=tuple(seconds[m]),
            left=left[m],
            checkpointed=m in checkpointed,
        )
        for m in sizes
    )
    return Race(timings, fastest, chosen, why, time.perf_counter() - began)


def without_checkpointed(raced: Race, why_not: str) -> Race:
    """``raced`` chosen again among the sizes it timed without checkpointing, as ``choose``
    would have chosen among them alone (a checkpointed winner that its verification refused:
    ``why_not`` says so, after the choice)."""
    seconds = {t.micro_size: list(t.seconds) for t in raced.timings if not t.checkpointed}
    if not seconds:
        raise ValueError("the race timed no size without checkpointing to fall back to")
    if all(seconds.values()):
        chosen, _, why = choose(seconds)
    else:  # a round short: the largest, untimed against the others
        chosen, why = max(seconds), "the largest that fits without checkpointing"
    return replace(raced, chosen=chosen, why=f"{why}; {why_not}")
