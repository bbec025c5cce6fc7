"""The prober: measured windows through a real Accumulator on the user's model, and the
memory model (a line per micro-batch size) fitted through them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gradaccum.batching import take
from gradaccum.engine import Accumulator
from gradaccum.memory import format_bytes, saved_activation_bytes, tensor_bytes
from gradaccum.planning.result import Fit, Probe
from gradaccum.precision import Precision
from gradaccum.recompute import (
    checkpointing_enabled,
    disable_checkpointing,
    enable_checkpointing,
)
from gradaccum.stats import fit_line

__all__ = ["Measured", "Prober", "fit", "fit_with"]

_WARMUP_WINDOWS = 30


def fit(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    return fit_with(xs, ys, *fit_line(xs, ys))


def fit_with(xs: Sequence[float], ys: Sequence[float], intercept: float, slope: float) -> Fit:
    errors = [abs(intercept + slope * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0]
    return Fit(intercept=intercept, slope=slope, max_error=max(errors, default=0.0))


@dataclass(frozen=True)
class Measured:
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


class Prober:
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
        # (micro_size, micro_batches, seconds) of each measured window after the warm-up: what
        # the plan estimates another line's cost from (speed.WindowCost)
        self.windows: list[tuple[int, int, float]] = []
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
        began = time.perf_counter()
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
        self.windows.append((size, micro_batches, time.perf_counter() - began))
        if self.acc.sync.distributed:  # the fullest rank's numbers, so every rank decides alike
            peak, saved = self.acc.sync.most([peak, saved])
        return peak, saved, stepped

    def timed(self, micro_sizes: Sequence[int], checkpointed: bool = False) -> float:
        """Seconds of one real window (``acc.step``) of micro-batches of ``micro_sizes``,
        the device synchronized at its start and end; the batches are made before. With
        ``checkpointed``, the window recomputes activations as training would; without, it
        saves them; the model's checkpointing is put back as it was after."""
        batches = [take(self.sample_batch, size) for size in micro_sizes]
        device = next(self.model.parameters()).device
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        switch = checkpointed != checkpointing_enabled(self.model)
        if switch:
            (enable_checkpointing if checkpointed else disable_checkpointing)(self.model)
        try:
            synchronize()
            began = time.perf_counter()
            self.acc.step(batches, self.loss_fn)
            synchronize()
            return time.perf_counter() - began
        finally:
            if switch:
                (disable_checkpointing if checkpointed else enable_checkpointing)(self.model)

    def measure(self, probe_sizes: Sequence[int], usable: float | None = None) -> Measured:
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
        self.windows.clear()  # the warm-up's one-time costs are no window's
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
    ) -> Measured:
        """The memory model through the probes measured so far."""
        xs = [m[0] for m in measured]
        peak_fit = fit(xs, [m[1] for m in measured])
        act_fit = fit(xs, [m[2] for m in measured])
        notes = []
        if peak_fit.slope < act_fit.slope:
            # Peak memory grows at least by what a sample saves for backward. Below that (a
            # small model on CPU, where the allocator's page reuse is noise at this size),
            # take the activations' slope and the lowest line above every measured peak.
            slope = act_fit.slope
            peaks = [m[1] for m in measured]
            intercept = max(y - slope * x for x, y in zip(xs, peaks, strict=True))
            peak_fit = replace(fit_with(xs, peaks, intercept, slope), bound=True)
            notes.append(
                "note: peak memory did not grow measurably with the micro-batch (allocator "
                "noise at this size); per-sample bytes are the saved activations'"
            )
        # What the first step of a fresh process allocates beyond its share (thread pools,
        # kernel workspaces): in a training run it is paid once, at the top of the peak.
        overhead = max(0, int(warm_peak - growth - peak_fit(first_size)))
        probes = tuple(Probe(s, pk, a, peak_fit(s)) for s, pk, a in measured)
        return Measured(
            static, overhead, peak_fit, act_fit, probes, tuple(self.blocks), tuple(notes),
            batch=self.batch_bytes,
        )  # fmt: skip
