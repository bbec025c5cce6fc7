"""The Accumulator: one window of micro-batches -> one optimizer step.

Every loss returns ``(loss_sum, count)``. Backward runs on the sum; at the window's end the
summed gradient is divided once by the window's total count: the full-batch mean gradient
whatever the micro-batch sizes, padding or a ragged last window. The engine is three calls,
``micro_batch()``, ``backward()`` and ``end_window()``; ``step()`` is a loop over them, so a
hand-written loop runs exactly the same arithmetic. Each concern around the window is a
module of its own: loss.py (the contract), window.py (the end's arithmetic), precision.py,
sync.py (data parallelism), oom.py, noise.py and checkpoint.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradaccum.batchnorm import warn_batchnorm
from gradaccum.checkpoint import FORMAT, check_state, saved_state, set_rng_state
from gradaccum.loss import window_input, window_loss
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay
from gradaccum.precision import PRECISIONS, Precision
from gradaccum.sync import SYNC_MODES, Sync
from gradaccum.validate import check_arguments, window_parameters
from gradaccum.window import AccumulatorState, Closing, SkipNonFinite, SkipPolicy, StepResult, Tally

__all__ = ["Accumulator", "AccumulatorState", "LossFn", "StepResult"]

LossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, int | torch.Tensor]"]


@dataclass
class _Window:
    """The window in progress (never checkpointed: checkpoints fall between windows): its
    tally, and where the manual API's calls stand."""

    tally: Tally = field(default_factory=Tally)
    in_micro_batch: bool = False
    backward_done: bool = False
    last: bool = False  # the micro-batch in progress is marked last
    ended_last: bool = False  # a micro-batch marked last has run
    coupled: bool = False  # a loss over the whole window: a prefix is no smaller batch's gradient


class Accumulator:
    """Runs windows of micro-batches; each window is one exact optimizer step.

    Args:
        model: the module being trained (plain, ``DistributedDataParallel`` or FSDP2).
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        scheduler: optional learning-rate scheduler; stepped once per optimizer step, never
            on a skipped window.
        max_grad_norm: optional clip on the global norm of the normalized window gradient.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a ``Precision`` (its accumulation
            dtype, its GradScaler). See ``gradaccum.precision``.
        sync: for a data-parallel model, ``"window"`` (one gradient reduction per window) or
            ``"micro"`` (one per micro-batch). See ``gradaccum.sync``.
        oom: an ``OOMReplay`` to replay a window at a smaller micro-batch size on
            ``torch.OutOfMemoryError`` in ``step()``; None lets the error propagate.
        noise: a ``NoiseScale`` to estimate the gradient noise scale from each window.
        skip: the skip policy, which decides from the window's gradient norm whether it is
            stepped on (``SkipNonFinite()``, the default: not when NaN or Inf).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any | None = None,
        max_grad_norm: float | None = None,
        precision: str | Precision = "fp32",
        sync: str = "window",
        oom: OOMReplay | None = None,
        noise: NoiseScale | None = None,
        skip: SkipPolicy | None = None,
    ) -> None:
        check_arguments(
            model,
            optimizer,
            scheduler,
            max_grad_norm,
            choices={
                "precision": (precision if isinstance(precision, str) else None, (*PRECISIONS,)),
                "sync": (sync, SYNC_MODES),
            },
            oom=(oom, OOMReplay),
            noise=(noise, NoiseScale),
            skip=(skip, SkipPolicy),
        )
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._params, self._step_params = window_parameters(model, optimizer)
        self.sync = Sync.of(model, sync)
        device_type = self._params[0].device.type
        self.precision = Precision.of(precision).bind(
            self._params, device_type, sharded=self.sync.sharded
        )
        self.sync.configure(self.precision, oom, noise)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.oom, self.noise = oom, noise
        self.skip = SkipNonFinite() if skip is None else skip
        self.state = AccumulatorState()
        self._window: _Window | None = None
        self._warned_batchnorm = False

    def __repr__(self) -> str:
        return (
            f"Accumulator({type(self.model).__name__}, {type(self.optimizer).__name__}, "
            f"max_grad_norm={self.max_grad_norm}, precision={self.precision!r}, "
            f"sync={self.sync!r}, oom={self.oom!r}, noise={self.noise!r}, state={self.state})"
        )

    # -- one window -------------------------------------------------------------------------

    def step(
        self,
        micro_batches: Iterable[Any],
        loss_fn: LossFn,
        counts: Callable[[Any], Mapping[str, Any]] | None = None,
    ) -> StepResult:
        """Run one window: forward and backward of every micro-batch, then one step.

        ``micro_batches``: an iterable of micro-batches (see ``ga.split``); ``loss_fn(model,
        micro_batch)`` returns ``(loss_sum, count)``, or named terms, each its own mean:
        ``{"ce": (ce_sum, tokens), "aux": (aux_sum, routed, 0.01)}`` (weight 1 when not
        given); or ``loss_fn`` is a ``WindowLoss`` that runs the window itself through the
        manual API (``ga.InBatch``, a loss over the whole window's embeddings: in-batch
        negatives, docs/losses.md). Terms need ``counts(micro_batch) -> {"ce":
        tokens, "aux": routed}``: each term's count is summed over the window and the ranks
        before the first backward, and must equal what ``loss_fn`` then counts.
        """
        if self._window is not None:
            raise RuntimeError(
                f"a manual window is open with {self._window.tally.micro_batches} micro-batches; "
                "finish it with end_window() or drop it with abort_window() before step()"
            )
        given = window_input(micro_batches, loss_fn, may_be_empty=self.sync.distributed)
        run = window_loss(loss_fn, counts).run

        def window(part: list[Any]) -> None:
            run(self, *self.sync.pad(part))

        replays = 0
        if self.oom is None:
            window(given)
        else:
            replays = self.oom.run(
                given,
                window,
                window=self.state.windows + 1,
                agree=self.sync.agree_oom if self.sync.distributed else None,
                drop=self.abort_window,
            )
        self.state.oom_replays += replays
        return dataclasses.replace(self.end_window(), oom_replays=replays)

    def begin_window(
        self, counts: Mapping[str, Any] | None = None, *, coupled: bool = False
    ) -> None:
        """Open a window before its first micro-batch (``micro_batch`` opens a plain one).

        ``counts``: a window whose loss is named terms: this rank's item count of each term
        over the whole window (``{"ce": tokens, "aux": routed}``). They are summed over ranks
        here (every rank calls this, with its own counts), so each micro-batch's backward can
        divide each term by its own global count. ``step(..., counts=fn)`` calls it with
        ``fn`` summed over the window.

        ``coupled``: the window's loss couples its micro-batches (in-batch negatives,
        ``ga.InBatch``): a micro-batch's gradient is then no smaller batch's gradient, so the
        noise estimate takes no prefix of it."""
        if self._window is not None:
            raise RuntimeError(
                f"begin_window() called in an open window after "
                f"{self._window.tally.micro_batches} micro-batches; a window's counts come "
                "before its first micro-batch"
            )
        window = self._open_window(coupled)
        if counts is None:
            return
        try:
            window.tally.begin(counts, self.sync)
        except BaseException:
            self._close_window()
            raise

    @contextlib.contextmanager
    def micro_batch(self, last: bool = False) -> Iterator[None]:
        """Context for one micro-batch in a hand-written loop: run its forward and call
        ``backward`` inside it.

        ``last``: this is the window's last micro-batch. Only a data-parallel model needs it
        (its backward is the one that communicates gradients); every rank must then run the
        same number of micro-batches per window, each marking its last one.

        An exception inside aborts the whole window (gradients cleared, parameters untouched)
        and propagates.
        """
        window = self._window if self._window is not None else self._open_window()
        if window.in_micro_batch:
            raise RuntimeError("micro_batch() contexts do not nest")
        window.in_micro_batch, window.backward_done, window.last = True, False, last
        try:
            self.sync.check_after_last(window.ended_last)
            with self.sync.micro_batch(last), self.precision.autocast():
                yield
            if not window.backward_done:
                raise RuntimeError(
                    f"micro-batch {window.tally.micro_batches} ended without "
                    "acc.backward(loss_sum, count); every micro-batch of a window must run "
                    "backward (use count 0 for one that holds no item)"
                )
        except BaseException:
            self.abort_window()
            raise
        window.in_micro_batch = False
        window.ended_last = window.ended_last or last

    def backward(self, loss_sum: Any, count: int | torch.Tensor | None = None) -> None:
        """Backpropagate one micro-batch's summed loss and record its item count; or, in a
        window begun with counts (``begin_window``), its named terms (a mapping, no count)."""
        window = self._window
        if window is None or not window.in_micro_batch:
            raise RuntimeError("backward() must be called inside `with acc.micro_batch():`")
        index = window.tally.micro_batches
        if window.backward_done:
            raise RuntimeError(
                f"backward() called twice in micro-batch {index - 1}; add the losses and "
                "counts and call it once"
            )
        # Recorded before the backward: a backward that fails drops the whole window.
        loss_sum, count = window.tally.add(loss_sum, count)
        self.sync.check_forward(index)
        scale_count = count
        if index == 0 and self.precision.scaler is not None and self.sync.distributed:
            # fp16's power-of-two pre-scale comes from the first micro-batch's count; DDP adds
            # the ranks' gradients, so every rank must pre-scale alike: the largest first count
            scale_count = self.sync.most([int(count)])[0]
        self.precision.backward(loss_sum, scale_count, index == 0, self._params)
        if self.noise is not None and not window.coupled:
            sums = [g for g in map(self.precision.accumulated, self._step_params) if g is not None]
            self.noise.record(sums, count, self.precision.loss_multiplier())
        window.backward_done = True

    def end_window(self) -> StepResult:
        """Divide the window's gradient once by its count, clip, guard, and step once."""
        window = self._window
        if window is None or window.tally.micro_batches == 0:
            raise ValueError(
                "empty window: no micro-batch ran since the last step; a window needs at least "
                "one micro-batch"
            )
        if window.in_micro_batch:
            raise RuntimeError("end_window() called inside a micro_batch() context")
        closing = Closing(
            self.sync,
            self.state,
            self.max_grad_norm,
            self.skip,
            self.noise,
            self.scheduler,
            self.precision,
        )

        def gather() -> tuple[list[torch.Tensor], float]:
            if self.sync.reduce_at_end:  # else the last backward reduced already
                sums = map(self.precision.accumulated, self._step_params)
                self.sync.reduce([g for g in sums if g is not None])
            return self.precision.gather(self.optimizer, self._step_params)

        def apply(step: bool) -> None:
            self.precision.apply(self.optimizer, self._step_params, step=step)

        try:
            self.sync.check_window_end(window.ended_last)
            result = closing.close(window.tally, gather, apply)
        except BaseException:
            self.abort_window()
            raise
        self._close_window()
        return result

    def abort_window(self) -> None:
        """Drop the window in progress: clear its gradients; parameters stay as they were."""
        self.precision.abort()
        if self.noise is not None:
            self.noise.drop_window()
        self._close_window()

    def _close_window(self) -> None:
        for p in self._params:
            p.grad = None
        self._window = None

    def accumulated_gradient(self) -> dict[str, torch.Tensor]:
        """The window's gradient summed so far, by parameter name: the sum of the micro-batch
        gradients, not yet divided by the count (loss scaling divided out). For diagnostics."""
        if self._window is None:
            raise RuntimeError("accumulated_gradient() is only defined inside a window")
        multiplier = self.precision.loss_multiplier()
        out = {}
        for p in self._params:
            g = self.precision.accumulated(p)
            if g is not None:
                name = self._names.get(id(p), f"param{len(out)}")
                out[name] = g.detach() if multiplier == 1 else g.detach() / multiplier
        return out

    @property
    def in_window(self) -> bool:
        """True between a window's first micro-batch and its end."""
        return self._window is not None

    def _open_window(self, coupled: bool = False) -> _Window:
        if not self._warned_batchnorm:
            self._warned_batchnorm = True
            warn_batchnorm(self.model)
        for p in self._params:
            if p.grad is not None:
                name = self._names.get(id(p), "an optimizer parameter")
                raise RuntimeError(
                    f"parameter {name} already has a gradient before the window's first "
                    "micro-batch; it would leak into this step. Clear it with "
                    "optimizer.zero_grad(set_to_none=True) before using the Accumulator"
                )
        self._window = _Window(coupled=coupled)
        return self._window

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit: model, optimizer,
        scheduler, the accumulator's counters and policies, and the random generators.
        Loadable with ``torch.load(..., weights_only=True)``. Only at a window boundary."""
        if self.in_window:
            raise RuntimeError(
                f"state_dict() called inside a window after {self._window.tally.micro_batches} "
                "micro-batches; checkpoint between windows so a resumed run is the same run"
            )
        model, optimizer = self.sync.state_dicts(self.optimizer)
        return saved_state(
            FORMAT,
            self.state,
            self.precision.scaler,
            model=model,
            optimizer=optimizer,
            scheduler=None if self.scheduler is None else self.scheduler.state_dict(),
            oom=None if self.oom is None else self.oom.state_dict(),
            noise=None if self.noise is None else self.noise.state_dict(),
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict()`` saved; refuses a mismatched checkpoint clearly,
        saying how, before changing anything."""
        if self.in_window:
            raise RuntimeError(
                "load_state_dict() called inside a window; call abort_window() first"
            )
        held = {"scheduler": self.scheduler, "scaler": self.precision.scaler}
        parts = ("model", "optimizer")
        check_state(state_dict, FORMAT, "Accumulator", AccumulatorState, parts, held)
        counters = state_dict["accumulator"]
        self.sync.load_state_dicts(self.optimizer, state_dict["model"], state_dict["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(state_dict["scaler"])
        self.state = AccumulatorState(**counters)
        # A policy's state is restored when both the checkpoint and this Accumulator have
        # one: a run may resume with a policy turned on or off.
        if self.oom is not None and state_dict.get("oom") is not None:
            self.oom.load_state_dict(state_dict["oom"])
        if self.noise is not None and state_dict.get("noise") is not None:
            self.noise.load_state_dict(state_dict["noise"])
        set_rng_state(state_dict["rng"])
