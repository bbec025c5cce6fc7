"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), read off the window for free.

Each micro-batch's gradient and the window's gradient are the mean gradient at two batch
sizes, B_small (the micro-batch's count) and B_big (the window's count). With G the true
gradient and Sigma the per-item gradient covariance,

    E|G_B|^2 = |G|^2 + tr(Sigma) / B,

so two sizes give unbiased estimates of both:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

The small batches are the window's prefixes: after micro-batch i, the gradient summed so
far is the sum over the first B_i items, a mean gradient at batch size B_i. Its squared
norm is one fused reduction over ``.grad`` (or the fp32 buffers): no extra backward, no
copy, no hook. A least-squares line through (1/B_i, |G_{B_i}|^2) over the window's prefixes
gives both estimates for that window (intercept |G|^2, slope tr(Sigma)).

One window's pair is very noisy (its spread is larger than its value), so the reading is
the ratio of their means over many windows: the windows of the last ``horizon`` share of
the items seen (half, by default: a stationary problem averages ever more windows, a
training run forgets its early gradients at the pace it trains, and a change of the
effective batch changes neither). Its uncertainty comes from batch means: the horizon's
windows fall into ``groups`` consecutive groups, whose means vary as much as the whole
mean's error times sqrt(groups) (consecutive windows are correlated through training;
groups of them much less). Fieller's interval for the ratio of two means turns that into a
``confidence`` interval for B_simple; it is bounded exactly when the mean |G|^2 is clearly
positive, and no reading is given before that.

Under DDP or FSDP2 (``sync="window"``) the prefixes are this rank's micro-batches before
the reduction, and the window's reduced gradient adds one point at the global batch size:
B_big is the whole global batch. Each rank fits its own prefixes and the shared global
point; rank 0's estimate is the one reported.

(Per-parameter gradient hooks can read each micro-batch's own gradient as it arrives, at
the price of a Python call per parameter per micro-batch. Prefix sums give the same
unbiased estimates with one fused norm per micro-batch; bench/noise.py measures the cost.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gradaccum.stats import fieller, fit_line, t_quantile
from gradaccum.window import read_together, total_norm

__all__ = [
    "BatchAdvice",
    "NoiseReading",
    "NoiseScale",
    "Tradeoff",
    "advice",
    "advise",
    "tradeoff_advice",
]

_MERGE_ABOVE = 2048  # stored entries; beyond it, neighbours merge pairwise
# Advice on the effective batch only from a reading that can carry it: an interval that pins
# B_simple within this factor (the trade-off's numbers are said under the same rule) ...
NARROW = 4.0
# ... resting on at least this many windows (the batch-means interval's 20 groups then hold
# a few windows each; consecutive windows are correlated through training).
ADVICE_WINDOWS = 50


@dataclass(frozen=True)
class NoiseReading:
    """B_simple with its interval, or why there is none yet.

    ``value``: tr(Sigma) / |G|^2 over the horizon's windows, in items (None while undefined);
    ``low``, ``high``: its ``confidence`` interval (``low`` >= 0); ``windows``: how many
    windows it rests on; ``why``: the reason for no value, in words."""

    value: float | None
    low: float | None
    high: float | None
    windows: int
    confidence: float
    why: str | None = None

    @property
    def interval(self) -> tuple[float, float] | None:
        return None if self.value is None else (self.low, self.high)

    def tradeoff(self, batch: float, reference: float = 1.0) -> Tradeoff | None:
        """What training at ``batch`` items per step costs against ``reference`` items per
        step (one sample), to the same loss, by McCandlish et al. (2018): steps S = S_min (1 +
        B_noise / B) and samples E = E_min (1 + B / B_noise), with B_noise read as B_simple.
        Each number is given at B_simple and at its interval's ends (both move monotonically
        with it). None without a reading, or for a batch not above the reference."""
        if self.value is None or not batch > reference > 0:
            return None

        def at(noise: float) -> tuple[float, float]:
            if noise <= 0:  # no noise: any batch takes the fewest steps' samples
                return batch / reference - 1, 0.0
            more = (1 + batch / noise) / (1 + reference / noise) - 1
            fewer = 1 - (1 + noise / batch) / (1 + noise / reference)
            return more, fewer

        (more, fewer), (more_hi, fewer_lo), (more_lo, fewer_hi) = (
            at(self.value),
            at(self.low),
            at(self.high),
        )
        # Numbers are worth saying when the interval pins B_simple within a factor of 4
        certain = self.low > 0 and self.high <= NARROW * self.low
        return Tradeoff(
            batch, reference, (more, more_lo, more_hi), (fewer, fewer_lo, fewer_hi), certain
        )


@dataclass(frozen=True)
class Tradeoff:
    """A batch against a smaller one, to the same loss: ``more_samples`` and ``fewer_steps``
    as fractions (0.25 is 25%), each ``(at B_simple, low, high)`` over its interval; when the
    interval is wide (``certain`` False) the sentence says it cannot put numbers on them."""

    batch: float
    reference: float
    more_samples: tuple[float, float, float]
    fewer_steps: tuple[float, float, float]
    certain: bool  # B_simple's interval within a factor of 4 (and above 0): worth numbers

    def sentence(self, against: str) -> str:
        """In words, ``against`` naming the smaller batch ("a batch of one sample")."""
        if not self.certain:
            return (
                f"against {against}, too uncertain yet to say how many more samples and fewer "
                "steps this batch takes (B_simple's interval spans more than a factor of 4)"
            )

        def pct(x: tuple[float, float, float]) -> str:
            return f"{x[0]:.0%} ({x[1]:.0%} to {x[2]:.0%})"

        return (
            f"against {against}, this batch should take about {pct(self.more_samples)} more "
            f"samples and {pct(self.fewer_steps)} fewer optimizer steps to reach the same loss "
            "(McCandlish et al. 2018, from B_simple and its interval)"
        )


@dataclass
class NoiseScale:
    """The estimator and its state: ``Accumulator(..., noise=NoiseScale())``.

    ``horizon``: the reading averages the windows of this last share of the items seen.
    ``confidence``: of the interval. ``groups``: consecutive groups of the horizon's windows
    whose means give the interval (batch means). One instance per Accumulator; its state
    travels with the Accumulator's checkpoints."""

    horizon: float = 0.5
    confidence: float = 0.9
    groups: int = 20
    items: int = 0  # items of every window folded in
    updates: int = 0  # windows folded in
    # [windows, items, sum of |G|^2 estimates, sum of tr(Sigma) estimates], oldest first
    _entries: list[list[float]] = field(default_factory=list, repr=False)
    _prefixes: list[tuple[torch.Tensor, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not number(self.horizon) or not 0 < self.horizon <= 1:
            raise ValueError(
                f"horizon must be a share of the items in (0, 1], got {self.horizon!r}"
            )
        if not number(self.confidence) or not 0.5 < self.confidence < 1:
            raise ValueError(f"confidence must be a number in (0.5, 1), got {self.confidence!r}")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 3:
            raise ValueError(f"groups must be an integer >= 3, got {self.groups!r}")
        self.horizon, self.confidence = float(self.horizon), float(self.confidence)

    def record(self, sums: list[torch.Tensor], count: Any, multiplier: float = 1.0) -> None:
        """After each micro-batch's backward: the window's gradient summed so far (``sums``,
        carrying the loss ``multiplier`` of fp16 scaling) and that micro-batch's own item
        count (int or 0-dim tensor). Both stay where they are: the window's end reads them
        with its other numbers, once (``pending``). A micro-batch of no items (a padding
        replay) leaves the prefix as it was."""
        self.add_prefix(total_norm(sums).square() / multiplier**2, count)

    def add_prefix(self, sq_norm: torch.Tensor, count: Any) -> None:
        """``record`` with the prefix's squared norm already taken.

        The one rule for prefixes, on every path: a prefix is this rank's own gradient, so
        each is kept, except that the window's last backward may have reduced the gradient
        across ranks (DDP's, in the last micro-batch): ``end_window(window_point=True)``
        then drops the last one and adds the window's global mean instead."""
        self._prefixes.append((sq_norm, count))

    def pending(self) -> list[Any]:
        """The window's prefixes so far, flat (squared norm, count, squared norm, ...), where
        they live: read to the host with the window's other numbers, together
        (``end_window(..., read=)``)."""
        return [x for prefix in self._prefixes for x in prefix]

    def end_window(
        self,
        window_sq_norm: float | None,
        total: int,
        window_point: bool = False,
        read: list[tuple[float, Any]] | None = None,
    ) -> NoiseReading:
        """Fold one window into the estimates; returns the reading after it.

        ``window_point``: add the window's mean gradient (squared norm ``window_sq_norm`` over
        ``total`` items) as a point of its own. Data-parallel training does: its prefixes are
        this rank's micro-batches before the reduction, and the window is the global batch.
        Alone, the last prefix already is the window. With ``window_point`` the last prefix
        is dropped: the last backward reduced it across ranks (``add_prefix``'s rule).
        ``read``: the prefixes' values (``pending``), read with the window's other numbers;
        else they are read here.
        """
        prefixes, self._prefixes = self._prefixes, []
        if read is None:
            values = read_together([x for prefix in prefixes for x in prefix])
            read = list(zip(values[0::2], values[1::2], strict=True))
        if window_point:
            read = read[:-1]
        read = [(s, c) for s, c in read if not (isinstance(c, int) and c == 0)]
        if window_sq_norm is None or total <= 0:
            return self.reading()
        # E|G_B|^2 = |G|^2 + tr(Sigma) / B is a line in 1/B: fit it by least squares through
        # every prefix (the whole window included). Each prefix alone gives an unbiased pair
        # too, but the long prefixes sit close to the window and their differences are noise.
        points, items = [], 0.0
        for sq, count in read:
            items += count  # items in each prefix
            if items > 0:
                points.append((1 / items, sq / (items * items)))
        if window_point:
            points.append((1 / total, window_sq_norm))
        if len({x for x, _ in points}) < 2:
            return self.reading()
        g2, trace = fit_line([x for x, _ in points], [y for _, y in points])
        self.updates += 1
        self.items += int(total)
        self._entries.append([1, int(total), g2, trace])
        self._forget()
        return self.reading()

    def _forget(self) -> None:
        """Keep the entries the horizon reaches (the newest, back to the one that crosses
        it); merge neighbours pairwise when there are too many, so a long run's state stays
        small. The horizon's start only moves forward, so what is dropped never returns."""
        wanted, kept, covered = self.horizon * self.items, 0, 0
        for entry in reversed(self._entries):
            kept += 1
            covered += entry[1]
            if covered >= wanted:
                break
        del self._entries[: len(self._entries) - kept]
        if len(self._entries) > _MERGE_ABOVE:
            merged = [
                [a + b for a, b in zip(*self._entries[i : i + 2], strict=True)]
                if i + 1 < len(self._entries)
                else self._entries[i]
                for i in range(0, len(self._entries), 2)
            ]
            self._entries = merged

    def drop_window(self) -> None:
        self._prefixes = []

    def estimates(self) -> tuple[float, float] | None:
        """The mean (|G|^2, tr(Sigma)) per window over the horizon, or None before the first
        window."""
        windows = sum(e[0] for e in self._entries)
        if windows == 0:
            return None
        return (
            sum(e[2] for e in self._entries) / windows,
            sum(e[3] for e in self._entries) / windows,
        )

    def reading(self) -> NoiseReading:
        """B_simple over the horizon with its ``confidence`` interval, or why there is none."""
        entries, conf = self._entries, self.confidence
        windows = int(sum(e[0] for e in entries))
        if len(entries) < 3:
            why = (
                "no window of 2+ micro-batches yet"
                if windows == 0
                else f"only {windows} window{'s' if windows > 1 else ''} in its horizon so far"
            )
            return NoiseReading(None, None, None, windows, conf, why)
        k = min(self.groups, len(entries))
        # Consecutive groups of about windows / k windows each (an entry is never split).
        sums = [[0.0, 0.0, 0.0] for _ in range(k)]
        seen = 0.0
        for n, _, g2, trace in entries:
            group = sums[min(int(seen * k / windows), k - 1)]
            group[0] += n
            group[1] += g2
            group[2] += trace
            seen += n
        sums = [s for s in sums if s[0] > 0]
        k = len(sums)
        g_mean = sum(s[1] for s in sums) / windows
        t_mean = sum(s[2] for s in sums) / windows
        # Batch means: the whole mean's (co)variance from the spread of the group means.
        dev = [(s[0] / windows, s[1] / s[0] - g_mean, s[2] / s[0] - t_mean) for s in sums]
        scale = k / (k - 1)
        v_g = scale * sum((w * g) ** 2 for w, g, _ in dev)
        v_t = scale * sum((w * t) ** 2 for w, _, t in dev)
        cov = scale * sum(w * w * g * t for w, g, t in dev)
        q = t_quantile((1 + conf) / 2, k - 1)
        interval = fieller(t_mean, g_mean, v_t, v_g, cov, q)
        if interval is None:
            why = (
                f"the mean |G|^2 over the last {windows} windows is not clearly positive: the "
                "true gradient is small against its noise (near convergence, or a batch far "
                "below the critical one)"
            )
            return NoiseReading(None, None, None, windows, conf, why)
        if t_mean <= 0:
            why = f"the mean tr(Sigma) over the last {windows} windows is not positive"
            return NoiseReading(None, None, None, windows, conf, why)
        low, high = interval
        return NoiseReading(t_mean / g_mean, max(low, 0.0), high, windows, conf)

    def value(self) -> float | None:
        return self.reading().value

    def state_dict(self) -> dict[str, Any]:
        return {
            "horizon": self.horizon,
            "confidence": self.confidence,
            "groups": self.groups,
            "items": self.items,
            "updates": self.updates,
            "entries": [list(e) for e in self._entries],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "entries" not in state:  # a checkpoint of the per-window EMA (gradaccum < 0.3)
            self.items = self.updates = 0
            self._entries = []
            return
        self.horizon, self.confidence = float(state["horizon"]), float(state["confidence"])
        self.groups, self.items = int(state["groups"]), int(state["items"])
        self.updates = int(state["updates"])
        self._entries = [[float(x) for x in e] for e in state["entries"]]


@dataclass(frozen=True)
class BatchAdvice:
    """What the noise reading says about the effective batch, structured: the measurement,
    then a direction and a batch only when the reading can carry them.

    ``direction``: "larger" or "smaller" when the whole interval lies on that side of the
    effective batch, the interval is narrow (within a factor of ``NARROW``) and rests on
    ``ADVICE_WINDOWS`` windows or more; else None, with ``why`` in words. ``batch``: the
    effective batch in samples nearest B_simple (None when a sample's items are not known).
    ``tradeoff``: the effective batch against ``batch``, by McCandlish et al. (2018): what
    moving costs (more steps toward a smaller batch, more samples toward a larger). The
    library gives words without any command's flags: ``sentence(name)`` takes how to name
    a batch of N samples (the command names its flag)."""

    effective_batch: float  # items per step
    reading: NoiseReading | None
    direction: str | None = None
    batch: int | None = None
    tradeoff: Tradeoff | None = None
    why: str | None = None
    items_per_sample: float | None = None

    def measurement(self) -> str:
        """B_simple with its interval and the windows it rests on, beside the batch."""
        head = "gradient noise scale"
        r = self.reading
        if r is None or (r.value is None and r.windows == 0):
            return f"{head}: not estimated yet (needs windows of 2+ micro-batches)"
        if r.value is None:
            return f"{head}: no reading yet: {r.why}"
        return (
            f"{head} B_simple ~ {r.value:,.0f} items per step ({r.confidence:.0%} interval "
            f"{r.low:,.0f} to {r.high:,.0f}, from the last {r.windows} windows); the effective "
            f"batch is {self.effective_batch:,.0f} items"
        )

    def sentence(self, name: Any = None) -> str | None:
        """The advice in words, or None where the measurement is all there is to say.
        ``name(n)``: how to name an effective batch of ``n`` samples (default "an effective
        batch of n samples")."""
        r = self.reading
        if r is None or r.value is None:
            return None
        if self.direction is None:
            return f"no advice on the effective batch: {self.why}"
        if name is None:

            def name(n: int) -> str:
                return f"an effective batch of {n:,} samples"

        target = "" if self.batch is None else f" ({name(self.batch)}, about B_simple)"
        t = self.tradeoff
        # each figure once, with what it counts; the benefit first, then what it costs
        if self.direction == "larger":
            if t is None:  # t: the larger batch against this one
                how = "in fewer optimizer steps, on nearly as few samples"
            else:
                how = (
                    f"in about {_pct(t.fewer_steps)} fewer optimizer steps, on about "
                    f"{_pct(t.more_samples)} more samples"
                )
            return (
                f"a larger batch{target} would reach the same loss {how}; that saves time "
                "where the batch runs in parallel (a GPU), not on a CPU that runs it in turn"
            )
        if t is None:  # t: this batch against the smaller one
            how = "on fewer samples, in more optimizer steps"
        else:
            more_steps = tuple(1 / (1 - f) - 1 for f in t.fewer_steps)
            fewer_samples = tuple(1 - 1 / (1 + m) for m in t.more_samples)
            how = (
                f"on about {_pct(fewer_samples)} fewer samples, in about {_pct(more_steps)} "
                "more optimizer steps"
            )
        return (
            f"a smaller batch{target} would reach the same loss {how}; the recipe's batch is "
            "what its learning rate was set for, and gradaccum keeps any batch exact, so keep "
            "it unless samples are what you are short of"
        )

    def __str__(self) -> str:
        said = self.sentence()
        return self.measurement() if said is None else f"{self.measurement()}\n{said}"


def _pct(x: tuple[float, float, float]) -> str:
    return f"{x[0]:.0%} ({min(x[1], x[2]):.0%} to {max(x[1], x[2]):.0%})"


def advise(
    effective_batch: float, reading: NoiseReading | None, items_per_sample: float | None = None
) -> BatchAdvice:
    """The advice on ``effective_batch`` (in items) from ``reading``, as a ``BatchAdvice``
    (``items_per_sample``: the items in a sample, to name the batch nearest B_simple)."""
    base = BatchAdvice(float(effective_batch), reading, items_per_sample=items_per_sample)
    if reading is None or reading.value is None:
        return base
    batch = None
    per = items_per_sample or None
    if per:
        batch = max(1, round(reading.value / per))
    low, high = reading.low, reading.high
    if reading.windows < ADVICE_WINDOWS:
        why = (
            f"the reading rests on {reading.windows} windows; advice waits for "
            f"{ADVICE_WINDOWS} (a longer run)"
        )
        return replace(base, batch=batch, why=why)
    if not (low > 0 and high <= NARROW * low):
        why = (
            f"B_simple's interval spans more than a factor of {NARROW:g}, too wide to name a batch"
        )
        return replace(base, batch=batch, why=why)
    if low <= effective_batch <= high:
        why = (
            "the effective batch lies inside B_simple's interval, so it cannot tell yet "
            "whether larger or smaller batches would do better"
        )
        return replace(base, batch=batch, why=why)
    direction = "larger" if low > effective_batch else "smaller"
    near = reading.value if batch is None else batch * per
    tradeoff = (
        reading.tradeoff(near, effective_batch)
        if direction == "larger"
        else reading.tradeoff(effective_batch, near)
    )
    return BatchAdvice(
        float(effective_batch), reading, direction, batch, tradeoff, None, items_per_sample
    )


def advice(
    effective_batch: int, reading: NoiseReading | None, items_per_sample: float | None = None
) -> str:
    """``advise(...)`` in words: the measurement, then the advice or why there is none."""
    return str(advise(effective_batch, reading, items_per_sample))


def tradeoff_advice(
    effective_batch: float, reading: NoiseReading | None, items_per_sample: float | None = None
) -> str | None:
    """The trade-off in words: this effective batch (in items) against a batch of one sample
    (one item when a sample's items are not known), or None when there is nothing to say."""
    found = None if reading is None else reading.tradeoff(effective_batch, items_per_sample or 1.0)
    if found is None:
        return None
    if items_per_sample is None:
        return found.sentence("a batch of one item")
    if round(items_per_sample) == 1:
        return found.sentence("a batch of one sample")
    return found.sentence(f"a batch of one sample ({items_per_sample:,.0f} items)")
