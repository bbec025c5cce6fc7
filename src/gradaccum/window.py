"""The window's arithmetic, written once: the tally of its micro-batches (items and summed
loss), the one close (divide the summed gradient once, measure, decide by the skip policy,
clip, fold the noise estimate, step, count, log) and what the window reports
(``StepResult``). The Accumulator, the framework windows and the pipeline window each keep a
``Tally`` and end through ``Closing.close``: every path computes the same thing.

Backward leaves the window's gradient as a sum over its items. One division by the window's
total (what the sum still carries besides the items, e.g. the fp16 pre-scale, included) makes
it the full-batch mean gradient. The norm is measured on the sum and divided by the same
divisor, since the norm of the mean is the norm of the sum over the divisor; clipping then
follows ``torch.nn.utils.clip_grad_norm_``'s rule on that norm. A non-finite norm means a
non-finite gradient somewhere: the window is skipped and the gradient left alone.
"""

from __future__ import annotations

import enum
import logging
import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradaccum.loss import (
    check_count,
    check_loss,
    check_term_count,
    count_value,
    unpack_term,
)

__all__ = [
    "AccumulatorState",
    "Closing",
    "Skip",
    "SkipNonFinite",
    "SkipPolicy",
    "StepResult",
    "Tally",
    "finish",
    "total_norm",
    "warn_skipped",
]

log = logging.getLogger("gradaccum")

_LOW = (torch.float16, torch.bfloat16)


@dataclass
class AccumulatorState:
    """Counters that travel with a checkpoint; all are totals since the run began."""

    optimizer_steps: int = 0
    windows: int = 0
    skipped_windows: int = 0
    micro_batches: int = 0
    items: int = 0
    oom_replays: int = 0

    def count_window(self, micro_batches: int, items: int, stepped: bool) -> None:
        self.windows += 1
        self.micro_batches += micro_batches
        self.items += items
        self.optimizer_steps += stepped
        self.skipped_windows += not stepped


@dataclass(frozen=True)
class StepResult:
    """What one window did: the one result of every path (the Accumulator's ``step`` and
    ``end_window``, ``PipelineWindow.step``, ``FrameworkWindow.end``).

    ``loss`` is the mean loss per item over the window (None when the window held no item);
    with named terms, the sum over terms of weight x the term's mean, each mean in ``terms``;
    ``grad_norm`` is the global norm of the normalized gradient before clipping (None when
    the window held no item); ``skipped`` is None or why the optimizer did not step (a
    ``Skip``); a framework's window, whose loop steps itself, reports what gradaccum would
    have decided.
    """

    loss: float | None
    count: int
    grad_norm: float | None
    stepped: bool
    skipped: str | None
    micro_batches: int
    step: int  # optimizer steps taken so far, this window included
    oom_replays: int = 0  # times this window was replayed at a smaller micro-batch size
    noise_scale: float | None = None  # B_simple so far (with a NoiseScale), else None
    noise_interval: tuple[float, float] | None = None  # its interval (NoiseScale.confidence)
    terms: dict[str, float | None] | None = None  # named terms: each one's mean (unweighted)

    @property
    def finite(self) -> bool:
        """The window's gradient is finite (an empty window's too)."""
        return self.grad_norm is None or math.isfinite(self.grad_norm)

    @property
    def b_simple(self) -> float | None:
        """``noise_scale`` under the name the framework integrations log it by."""
        return self.noise_scale


class Tally:
    """The window in progress as numbers: its micro-batches, their item count and summed loss.

    A loss is one ``(loss_sum, count)`` pair, or named terms (``begin`` first), each its own
    mean: ``{"ce": (ce_sum, tokens), "aux": (aux_sum, routed, 0.01)}``. The window's gradient
    is the sum over terms of weight x the term's summed gradient / the term's count, counts
    over the window and every rank. A pair's count is learned as the micro-batches run and its
    gradient divided once at the end (``Closing.close``). Terms need their counts before the first
    backward (``begin``: this rank's counts, all-reduced there): each micro-batch then
    backpropagates ``sum_t c_t * loss_sum_t`` with ``c_t = weight_t * K / N_t``, and the
    end's one division is by ``K``, the first term with items (``N_t``, ``K``: global counts).
    The first term's coefficient is 1: a pair is the one-term case of the same arithmetic.

    Nothing here waits for the device: the losses are summed where they live (in float64)
    and a count left on a GPU is read once, at the window's end, with the
    others."""

    def __init__(self) -> None:
        self.micro_batches = 0  # recorded so far: the next one's index
        self._count = 0  # counts known on the host
        self._device_counts: list[tuple[int, torch.Tensor]] = []  # (index, count) on a device
        # the summed loss, float64 where the loss lives: one tensor made at the first
        # micro-batch and added to in place. (Not a list of each micro-batch's detached loss:
        # a small tensor kept per micro-batch, made between its activations, pins glibc's
        # heap where they were freed, and a CPU run of 16 micro-batches per window peaked
        # 43% above its plan with glibc as it comes: bench/results/planner.md.)
        self._loss: torch.Tensor | None = None
        self._terms: list[_Term] | None = None  # named terms, after begin()
        self._divisor = 0.0  # K: the first term's global count that is not zero

    def begin(self, counts: Any, sync: Any) -> None:
        """Named terms: this rank's item count of each term over the whole window, before its
        first backward (``{"ce": tokens, "aux": routed}``), summed over ranks here (one
        all-reduce of as many numbers as terms)."""
        if self.micro_batches:
            raise RuntimeError(
                f"the window's counts must be given before its first micro-batch, after "
                f"{self.micro_batches}"
            )
        if not isinstance(counts, Mapping) or not counts:
            raise TypeError(
                "counts must map each term's name to its item count over the window, e.g. "
                f"{{'ce': tokens, 'aux': routed}}, got {_shown(counts)}"
            )
        local = [check_term_count(n, name) for name, n in counts.items()]
        # The names' checksum rides along: ranks that name the terms differently (or in
        # another order) would add one term's counts to another's.
        names = zlib.crc32("\0".join(map(str, counts)).encode())
        *totals, named = sync.sum([*local, names])
        if named != names * sync.ranks:
            raise ValueError(
                f"the ranks' counts name different terms, or the same in another order (this "
                f"rank: {', '.join(map(str, counts))}); every rank gives every term, in one order"
            )
        self._terms = [
            _Term(str(name), n, t) for name, n, t in zip(counts, local, totals, strict=True)
        ]
        self._divisor = next((t for t in totals if t > 0), 0.0)

    def add(self, loss_sum: Any, count: Any = None) -> tuple[torch.Tensor, Any]:
        """One micro-batch's loss, checked (an error names the micro-batch by its index) and
        recorded: ``(loss_sum, count)``, or a mapping of named terms with ``count`` None.
        Returns the loss whose backward runs and the micro-batch's count (a pair's, or the
        first term's, as the noise estimate and the fp16 pre-scale read it)."""
        index = self.micro_batches
        if isinstance(loss_sum, Mapping) or self._terms is not None:
            loss, count = self._add_terms(loss_sum, count, index)
        else:
            loss, count = check_loss(loss_sum, index), check_count(count, index)
            if isinstance(count, torch.Tensor):
                self._device_counts.append((index, count))
            else:
                self._count += count
            if self._loss is None:
                self._loss = loss.detach().new_zeros((), dtype=torch.float64)
            self._loss.add_(loss.detach())
        self.micro_batches += 1
        return loss, count

    def _add_terms(self, terms: Any, count: Any, index: int) -> tuple[torch.Tensor, Any]:
        parsed = self._parse(terms, count, index)
        for term, loss, n, weight in parsed:
            term.record(loss, n, weight, index)
        return self._combined(parsed), parsed[0][2]

    def combine(self, terms: Any, index: int) -> tuple[torch.Tensor, Any]:
        """The loss whose backward runs for ``terms`` (each times weight x K / N), and the
        first term's count, without recording them: a pipeline schedule computes a loss
        more often than it runs micro-batches (its first step infers shapes), so the
        pipeline window records the micro-batches' terms once the schedule is done."""
        parsed = self._parse(terms, None, index)
        return self._combined(parsed), parsed[0][2]

    def _combined(self, parsed: list[tuple[_Term, torch.Tensor, Any, float]]) -> torch.Tensor:
        backward: torch.Tensor | None = None
        for term, loss, _, weight in parsed:
            part = loss * term.coefficient(self._divisor, weight)
            backward = part if backward is None else backward + part
        return backward

    def _parse(
        self, terms: Any, count: Any, index: int
    ) -> list[tuple[_Term, torch.Tensor, Any, float]]:
        """Each of the window's terms with its micro-batch's loss, count and weight, checked."""
        where = f"from micro-batch {index}"
        if self._terms is None:
            raise TypeError(
                f"the loss returned named terms ({', '.join(map(repr, terms))}) {where}, but "
                "the window's counts were not given: each term is divided by its own count "
                "over the window, which its backward needs first; pass step(..., "
                "counts=fn) or call acc.begin_window(counts) (docs/losses.md)"
            )
        if not isinstance(terms, Mapping) or count is not None:
            raise TypeError(
                f"the window was begun with named terms ({', '.join(t.name for t in self._terms)}"
                f"), so the loss must be a mapping of them, got {_shown(terms)} {where}"
            )
        names = [t.name for t in self._terms]
        if set(map(str, terms)) != set(names):
            missing = sorted(set(names) - set(map(str, terms)))
            extra = sorted(set(map(str, terms)) - set(names))
            problems = [f"missing {missing}"] if missing else []
            problems += [f"not counted {extra}"] if extra else []
            raise ValueError(
                f"the loss's terms {where} are not the window's counts' terms ({names}): "
                + "; ".join(problems)
            )
        given = {str(k): v for k, v in terms.items()}
        return [(t, *unpack_term(given[t.name], t.name, index)) for t in self._terms]

    @property
    def named(self) -> bool:
        """The window's loss is named terms (``begin``), not one pair."""
        return self._terms is not None

    def sums(self) -> tuple[Any, Any]:
        """A pair's item count and summed loss on this rank, where they are: a float64
        tensor on the device where a count or the loss lives there (nothing read to the
        host), else numbers. The device counts themselves are in ``device_counts``, for
        ``check_counts`` once they are read."""
        count: Any = self._count
        if self._device_counts:
            count = torch.stack([c.to(torch.float64) for _, c in self._device_counts]).sum()
            count = count + self._count
        return count, (0.0 if self._loss is None else self._loss)

    def device_counts(self) -> list[torch.Tensor]:
        return [c for _, c in self._device_counts]

    def check_counts(self, values: list[float]) -> None:
        """The device counts' values, read (``device_counts``' order): each a whole,
        non-negative number of items, or the error naming its micro-batch."""
        for (index, _), value in zip(self._device_counts, values, strict=True):
            count_value(value, index)

    def totals(self, sync: Any) -> tuple[float, float]:
        """Named terms (a pair's are ``sums``): ``K`` (the end's divisor) and ``K`` times the
        weighted sum of the terms' means over every rank, so that loss / count is the
        window's loss; one all-reduce of the terms' sums, read on the host, where the
        terms' counts are checked against those the window was begun with."""
        sums = [t.local_sum() for t in self._terms]
        wrong = [t for t in self._terms if not t.counted_as_begun()]
        reduced = sync.sum([*sums, float(len(wrong))])
        if reduced[-1]:
            raise ValueError(
                "the loss's counts over the window differ from the counts it was begun with: "
                + (
                    "; ".join(
                        f"{t.name}: {t.seen:g} counted by the loss, {t.local:g} given"
                        for t in wrong
                    )
                    or "on another rank"
                )
                + "; the gradient used the given counts, so the window is dropped"
            )
        for term, total in zip(self._terms, reduced, strict=False):
            term.total_sum = total
        loss = sum(t.coefficient(self._divisor) * t.total_sum for t in self._terms)
        return self._divisor, loss

    def means(self) -> dict[str, float | None] | None:
        """After ``totals``: each term's mean over the window (None for a term with no item),
        or None for a pair."""
        if self._terms is None:
            return None
        return {t.name: (t.total_sum / t.total if t.total > 0 else None) for t in self._terms}


class _Term:
    """One named term of a window: its counts (this rank's and global, given at ``begin``),
    its weight, what its micro-batches summed and counted."""

    def __init__(self, name: str, local: float, total: float) -> None:
        self.name, self.local, self.total = name, local, total
        self.weight: float | None = None
        self.seen = 0.0  # counted by the loss on this rank (host counts)
        self._device_counts: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None
        self.total_sum = 0.0
        self.last_count: Any = 0

    def coefficient(self, divisor: float, weight: float | None = None) -> float:
        """What this term's summed loss is multiplied by before backward: weight x K / N
        (its recorded weight unless ``weight`` is given)."""
        weight = self.weight if weight is None else weight
        return 0.0 if self.total <= 0 else (weight or 0.0) * divisor / self.total

    def record(self, loss: torch.Tensor, count: Any, weight: float, index: int) -> None:
        if self.weight is None:
            self.weight = weight
        elif weight != self.weight:
            raise ValueError(
                f"term {self.name!r} has weight {weight:g} in micro-batch {index} but "
                f"{self.weight:g} earlier in the window; a term's weight is one per window"
            )
        if isinstance(count, torch.Tensor):
            self._device_counts.append(count)
        else:
            self.seen += count
        self.last_count = count
        if self._sum is None:
            self._sum = torch.zeros((), dtype=torch.float64, device=loss.device)
        self._sum.add_(loss.detach().to(self._sum.device))

    def local_sum(self) -> float:
        if self._device_counts:
            self.seen += float(torch.stack([c.double() for c in self._device_counts]).sum())
            self._device_counts = []
        return 0.0 if self._sum is None else self._sum.item()

    def counted_as_begun(self) -> bool:
        return abs(self.seen - self.local) <= 1e-9 * max(1.0, abs(self.local))


def _shown(value: Any) -> str:
    return f"a {type(value).__name__}" if not isinstance(value, Mapping) else "an empty mapping"


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors, the sum of squares in at least fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    # fp32/fp64 in one fused kernel (what clip_grad_norm_ runs); low precision widened per
    # tensor without a copy, so a bf16 gradient's norm is not itself rounded to bf16.
    dtypes = {g.dtype for g in grads}
    if dtypes.isdisjoint(_LOW):
        norms = torch._foreach_norm(grads)
    else:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.dtype in _LOW]
        wide = [g for g in grads if g.dtype not in _LOW]
        if wide:
            norms.extend(torch._foreach_norm(wide))
    # Several devices or dtypes: added in float64 on the first's. (get_device, an int, and
    # dtype are cheap to read; a tensor's .device builds an object each time.)
    if len({n.dtype for n in norms}) > 1 or len({g.get_device() for g in grads}) > 1:
        norms = [n.to(norms[0].device, torch.float64) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def finish(
    grads: list[torch.Tensor],
    divisor: float,
    max_grad_norm: float | None,
    norm: Callable[[list[torch.Tensor]], torch.Tensor] = total_norm,
    skip: SkipPolicy | None = None,
) -> tuple[float, bool]:
    """Divide ``grads`` (the window's summed gradient) by ``divisor`` in place and clip them to
    ``max_grad_norm``. Returns the normalized gradient's norm before clipping and whether the
    window steps: ``skip`` (``SkipNonFinite()`` by default) refuses it, and a refused
    gradient is left as it is. ``divide_and_clip`` with its two numbers read.

    ``norm`` measures the global norm (``Sync.norm`` adds the other ranks' shards)."""
    grad_norm, steps = divide_and_clip(grads, divisor, max_grad_norm, norm, skip)
    return float(grad_norm), bool(steps)


def divide_and_clip(
    grads: list[torch.Tensor],
    divisor: Any,
    max_grad_norm: float | None,
    norm: Callable[[list[torch.Tensor]], torch.Tensor] = total_norm,
    skip: SkipPolicy | None = None,
    keep: Any = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's division, norm, decision and clip where the gradient lives, nothing read
    to the host (as GradScaler decides on the device): returns the mean gradient's norm
    before clipping (float64) and whether the window steps (a bool tensor: ``skip`` does
    not refuse it, and ``keep``, e.g. the count is not 0). ``divisor``: a number or a
    float64 tensor.

    One pass over the gradient, whatever the settings: a multiplication by one factor,
    1 / ``divisor`` times the clip coefficient where the clip applies (computed in float64,
    rounded once to the precision the pass runs in). A window that does not step is
    multiplied by exactly 1: its gradient is left as it is."""
    grad_norm = norm(grads).double()
    if not isinstance(divisor, torch.Tensor):
        divisor = torch.full_like(grad_norm, divisor)
    grad_norm = grad_norm / divisor
    steps = (skip or SKIP_NON_FINITE).skips(grad_norm).logical_not()
    if keep is not True:  # x & True is x: no op for the count the host knows is not 0
        steps = steps & keep
    if not grads:
        return grad_norm, steps
    factor = divisor.reciprocal()
    if max_grad_norm is not None:
        # torch's clip_grad_norm_ rule: max / (norm + 1e-6) where that is below 1
        coef = torch.full_like(grad_norm, max_grad_norm) / (grad_norm + 1e-6)
        factor = torch.where(coef < 1.0, factor * coef, factor)
    factor = torch.where(steps, factor, torch.ones_like(factor))
    # float64 gradients by the float64 factor, every other dtype by it in float32 (a
    # low-precision gradient is multiplied in float32 and rounded once to its dtype).
    dtypes = {g.dtype for g in grads}
    for dtype in dtypes:
        group = grads if len(dtypes) == 1 else [g for g in grads if g.dtype == dtype]
        torch._foreach_mul_(
            group, factor.to(torch.float64 if dtype == torch.float64 else torch.float32)
        )
    return grad_norm, steps


def read_together(values: list[Any]) -> list[Any]:
    """Each value as a Python number: the 0-dim tensors that live on a device read to the
    host together, in one transfer (stacked as float64): a window's one host
    synchronization; a tensor on the CPU by ``item()`` (no wait), a number as it is."""
    device = [v.detach().reshape(()).to(torch.float64) for v in values if _on_device(v)]
    read = iter(torch.stack(device).cpu().tolist() if device else ())
    return [
        next(read) if _on_device(v) else v.item() if isinstance(v, torch.Tensor) else v
        for v in values
    ]


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_cpu


# -- why a window does not step -------------------------------------------------------------


class Skip(enum.StrEnum):
    """Why a window did not step (``StepResult.skipped``); each reason written here once.
    A member is its string: ``result.skipped == "fp16 overflow"`` holds."""

    ZERO_COUNT = "zero count"  # the window held no item: there is no mean to step on
    NON_FINITE = "non-finite gradient"  # a NaN or Inf somewhere in the gradient
    FP16_OVERFLOW = "fp16 overflow"  # the same under fp16: the loss scaler lowers its scale


class SkipPolicy:
    """Whether a window's gradient is stepped on, decided from its norm (the mean gradient's,
    before clipping), as optax's ``MultiSteps(should_skip_update_fn=...)`` decides: an object
    owning its own settings. ``skips(grad_norm)`` takes the norm as a 0-dim float64 tensor
    where the gradient lives and returns a bool tensor there, True to skip (decided on the
    device, read with the window's other numbers); ``reason(scaled)`` says why
    (``scaled``: an fp16 loss scaler is in use)."""

    def skips(self, grad_norm: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reason(self, scaled: bool) -> str:
        raise NotImplementedError


class SkipNonFinite(SkipPolicy):
    """Skip a window whose gradient is not finite (its norm NaN or Inf): the default. A NaN
    anywhere makes the norm NaN, so the norm alone decides, on every rank alike."""

    def __repr__(self) -> str:
        return "SkipNonFinite()"

    def skips(self, grad_norm: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(grad_norm).logical_not()

    def reason(self, scaled: bool) -> str:
        return Skip.FP16_OVERFLOW if scaled else Skip.NON_FINITE


SKIP_NON_FINITE = SkipNonFinite()


# -- the window's end, for every path ---------------------------------------------------------


@dataclass
class Closing:
    """What ends every window of one runner (an Accumulator, a pipeline stage, a framework's
    loop), through ``close``: its ``Sync``, its counters, its clip and skip policy, its
    noise estimate and learning-rate scheduler. The runner keeps one and calls ``close``
    at each window's end; nothing else divides, measures, decides or reports a window."""

    sync: Any
    state: AccumulatorState = field(default_factory=AccumulatorState)
    max_grad_norm: float | None = None
    skip: SkipPolicy = field(default_factory=SkipNonFinite)
    noise: Any = None  # a NoiseScale, or None
    scheduler: Any = None  # stepped once per optimizer step (a runner that steps)
    precision: Any = None  # a Precision: its loss scale, for the skip's reason and the log

    def close(
        self,
        tally: Tally,
        gather: Callable[[], tuple[list[torch.Tensor], float]],
        apply: Callable[[bool], None] | None = None,
        *,
        scale: float = 1.0,
    ) -> StepResult:
        """End the window whose numbers ``tally`` holds.

        ``gather()`` returns this rank's summed gradient and what it still carries besides
        the items (the fp16 pre-scale, a framework's own division); it is called only for a
        window that holds items. ``apply(step)`` hands the optimizer the gradient and steps
        it, or not (the runner's own: a framework's loop steps itself and passes None).
        ``scale``: an fp16 loss scale still on the gradient, which the framework divides out
        later (only the reported norm is corrected for it).

        The order is the arithmetic's: the global count and loss; one division per term and
        the norm; the skip policy's decision; the clip; the noise estimate folds the window
        (a skipped window's prefixes are dropped); the step, the scheduler; the counters;
        one log line for a skipped window."""
        if tally.named:  # each term's sums and counts checked on the host first
            total, loss_total = tally.totals(self.sync)
        else:  # where they live, summed over ranks
            total, loss_total = self.sync.totals(*tally.sums())
        grads, carried = gather()
        grad_norm_t, steps_t = divide_and_clip(
            self.sync.local(grads),
            total * carried / self.sync.world,
            self.max_grad_norm,
            self.sync.norm,
            self.skip,
            keep=total > 0,
        )
        prefixes = [] if self.noise is None else self.noise.pending()
        counts = tally.device_counts()
        # The window's one read to the host: count, loss, norm, decision, the counts left
        # on the device (checked now) and the noise estimate's prefixes, together.
        total, loss_total, grad_norm, steps, *rest = read_together(
            [total, loss_total, grad_norm_t, steps_t, *counts, *prefixes]
        )
        tally.check_counts(rest[: len(counts)])
        prefixes = rest[len(counts) :]
        skipped: str | None = None
        if total == 0:
            skipped, grad_norm = Skip.ZERO_COUNT, None
        else:
            grad_norm /= scale
            if not steps:
                scaled = self.precision is not None and self.precision.scaler is not None
                skipped = self.skip.reason(scaled)
        reading = None
        if self.noise is not None and skipped is None:
            window_point = self.sync.reduces(True)  # the last prefix is not this rank's alone
            read = list(zip(prefixes[0::2], prefixes[1::2], strict=True))
            reading = self.noise.end_window(grad_norm**2, round(total), window_point, read)
        elif self.noise is not None:  # a skipped window's prefixes are not the next one's
            self.noise.drop_window()
        before = None if self.precision is None else self.precision.scale()
        if apply is not None:
            apply(skipped is None)
            if skipped is None and self.scheduler is not None:
                self.scheduler.step()
        self.state.count_window(tally.micro_batches, round(total), stepped=skipped is None)
        if skipped is not None and apply is not None:
            after = None if self.precision is None else self.precision.scale()
            warn_skipped(self.state, skipped, grad_norm, before, after)
        return StepResult(
            loss=loss_total / total if total else None,
            count=round(total),
            grad_norm=grad_norm,
            stepped=skipped is None,
            skipped=skipped,
            micro_batches=tally.micro_batches,
            step=self.state.optimizer_steps,
            noise_scale=None if reading is None else reading.value,
            noise_interval=None if reading is None else reading.interval,
            terms=tally.means(),
        )


def warn_skipped(
    state: Any, why: str, grad_norm: float | None, scale: float | None, new_scale: float | None
) -> None:
    """One log line for a skipped window: why, its norm, the fp16 loss scale's change."""
    rescaled = f"; loss scale {scale:g} -> {new_scale:g}" if scale else ""
    log.warning(
        "window %d skipped (%s, grad norm %s)%s; %d skipped so far",
        *(state.windows, why, grad_norm, rescaled, state.skipped_windows),
    )
