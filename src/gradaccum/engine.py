"""The Accumulator: one window of micro-batches -> one optimizer step.

Every loss returns ``(loss_sum, count)``. Backward runs on the sum; at the window's end the
summed gradient is divided once by the window's total count, which is the full-batch mean
gradient whatever the micro-batch sizes, padding or a ragged last window. Clipping, the
non-finite guard, the optimizer step and the scheduler step all happen there, once.

``step()`` is a loop over the manual API (``micro_batch()``, ``backward()``,
``end_window()``), so a user who keeps their own loop runs exactly the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from gradaccum.batching import batch_size
from gradaccum.memory import OOMPolicy
from gradaccum.noise import NoiseScale
from gradaccum.precision import Precision
from gradaccum.sync import Sync, total_norm

__all__ = ["Accumulator", "AccumulatorState", "StepResult"]

log = logging.getLogger("gradaccum")

_FORMAT = "gradaccum.accumulator/1"

LossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, int | torch.Tensor]"]


@dataclass
class AccumulatorState:
    """Counters that travel with a checkpoint; all are totals since the run began."""

    optimizer_steps: int = 0
    windows: int = 0
    skipped_windows: int = 0
    micro_batches: int = 0
    items: int = 0
    oom_replays: int = 0


@dataclass(frozen=True)
class StepResult:
    """What one window did.

    ``loss`` is the mean loss per item over the window (None when the window held no item);
    ``grad_norm`` is the global norm of the normalized gradient before clipping (None when
    the window held no item); ``skipped`` is None or why the optimizer did not step.
    """

    loss: float | None
    count: int
    grad_norm: float | None
    stepped: bool
    skipped: str | None
    micro_batches: int
    step: int  # optimizer steps taken so far, this window included
    oom_replays: int = 0  # times this window was replayed at a smaller micro-batch size
    noise_scale: float | None = None  # B_simple so far (``noise_scale=True``), else None


@dataclass
class _Window:
    """The window in progress (never checkpointed: checkpoints fall between windows)."""

    micro_batches: int = 0
    int_count: int = 0
    tensor_counts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    loss_sum: torch.Tensor | None = None  # losses on an accelerator, summed there (float64)
    host_loss_sum: float = 0.0  # losses on the CPU, summed as Python floats (also float64)
    in_micro_batch: bool = False
    backward_done: bool = False
    synced: bool = False  # a micro-batch marked last=True has run
    synced_now: bool = False  # the micro-batch in progress communicates gradients


class _MicroBatch:
    """``Accumulator.micro_batch()``: a plain class rather than a generator context, and no
    inner contexts unless the model is data-parallel or autocast is on. It runs on every
    micro-batch, where each Python step costs more than it does in isolation (the forward
    and backward just evicted the interpreter's data from the CPU caches)."""

    __slots__ = ("acc", "last", "inner", "window")

    def __init__(self, acc: Accumulator, last: bool) -> None:
        self.acc, self.last = acc, last
        self.inner: contextlib.ExitStack | None = None
        self.window: _Window | None = None

    def __enter__(self) -> None:
        acc = self.acc
        if acc._window is None:
            acc._open_window()
        window = acc._window
        assert window is not None
        if window.in_micro_batch:
            raise RuntimeError("micro_batch() contexts do not nest")
        sync = acc._sync
        if window.synced and sync.mode == "window":
            acc.abort_window()
            raise RuntimeError(
                "micro_batch() after the one marked last=True: its gradient would miss the "
                "reduction; end the window with end_window() first"
            )
        window.in_micro_batch = True
        window.backward_done = False
        window.synced_now = self.last or sync.mode == "micro"
        self.window = window
        if sync.distributed or acc._mp.autocast_dtype is not None:
            inner = contextlib.ExitStack()
            try:
                inner.enter_context(sync.micro_batch(self.last))
                inner.enter_context(acc._mp.autocast())
            except BaseException:
                inner.close()
                acc.abort_window()
                raise
            self.inner = inner

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        acc = self.acc
        try:
            if self.inner is not None:
                self.inner.__exit__(exc_type, exc, tb)
        except BaseException:
            acc.abort_window()
            raise
        finally:
            self.inner = None
        if exc_type is not None:
            acc.abort_window()
            return  # the exception propagates
        window = self.window
        assert window is not None
        if not window.backward_done:
            acc.abort_window()
            raise RuntimeError(
                f"micro-batch {window.micro_batches} ended without acc.backward(loss_sum, count);"
                " every micro-batch of a window must run backward (use count 0 for one that "
                "holds no item)"
            )
        window.in_micro_batch = False
        window.micro_batches += 1
        window.synced = window.synced or self.last


def _check_distributed(sync: Sync, mp: Precision, noise_scale: bool) -> None:
    """What the data-parallel path does not do yet, refused with the reason."""
    problems = []
    if mp.accumulate_dtype is not None:
        problems.append(
            f"accumulate_dtype={mp.accumulate_dtype}: fp32 buffers take each micro-batch's "
            f"gradient out of .grad, so {sync.kind.upper()}'s reduction on the last micro-batch "
            "would miss the others; keep fp32 parameters under autocast (precision='bf16'), "
            "or use FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.float32)"
        )
    if sync.kind == "fsdp" and mp.scaler is not None:
        problems.append(
            "precision='fp16' under FSDP2: each rank would see only its shards' overflow; "
            "use precision='bf16'"
        )
    if noise_scale and sync.mode == "micro":
        problems.append(
            "noise_scale=True with sync='micro': every prefix of the window is then reduced "
            "across ranks, and its global item count is not known without one more "
            "all-reduce per micro-batch; use sync='window'"
        )
    if problems:
        raise ValueError(
            f"the Accumulator on a {sync.kind.upper()} model cannot use:\n  - "
            + "\n  - ".join(problems)
        )


def _check_count(count: Any, index: int) -> int | torch.Tensor:
    """A Python count, or a tensor count on the CPU (reading it costs nothing), is checked
    now; a count on an accelerator is checked at the window's end, with one host sync for the
    whole window instead of one per micro-batch."""
    where = f"from micro-batch {index}"
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"count must be an integer or a 0-dim tensor, got a tensor of shape "
                f"{tuple(count.shape)} {where}"
            )
        # On the CPU the Python value is read now and its type checked (fewer steps than
        # the tensor's dtype); an accelerator's count is checked by dtype and read later.
        if count.is_cpu:
            value = count.item()
            bad_dtype = isinstance(value, (bool, complex))
        else:
            value, bad_dtype = None, count.is_complex() or count.dtype == torch.bool
        if bad_dtype:
            raise ValueError(
                f"count must be a real number of items, got dtype {count.dtype} {where}"
            )
        return count.detach().reshape(()) if value is None else _count_value(value, index)
    if isinstance(count, bool):
        raise ValueError(f"count must be a non-negative integer, got {count!r} {where}")
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r} {where}")
    return count


def _count_value(value: float, index: int) -> int:
    """A count read from a tensor: a whole number of items, or the error naming it."""
    if value < 0 or not float(value).is_integer():
        raise ValueError(
            f"count must be a non-negative integer, got {value:g} from micro-batch {index}"
        )
    return int(value)


def _check_loss(loss_sum: Any, index: int) -> torch.Tensor:
    where = f"from micro-batch {index}"
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(f"loss_sum must be a 0-dim tensor, got {type(loss_sum).__name__} {where}")
    if loss_sum.dim() != 0:
        raise ValueError(
            f"loss_sum must be a 0-dim tensor (the loss summed over the micro-batch's items), got "
            f"shape {tuple(loss_sum.shape)} {where}; reduce it with .sum() or ga.sample_mean"
        )
    if not loss_sum.is_floating_point():
        raise TypeError(f"loss_sum must be a floating-point tensor, got {loss_sum.dtype} {where}")
    if not loss_sum.requires_grad:
        raise ValueError(
            f"loss_sum {where} does not require grad: was it computed under torch.no_grad(), "
            "detached, or from a model with no trainable parameters?"
        )
    return loss_sum


def _unpack(result: Any, index: int) -> tuple[Any, Any]:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (
            f"a {type(result).__name__} of length {len(result)}"
            if isinstance(result, (tuple, list))
            else f"a {type(result).__name__}"
        )
        raise TypeError(
            f"loss_fn must return (loss_sum, count), got {got} from micro-batch {index}; return "
            "the loss summed over the micro-batch's items and the number of items, e.g. "
            "ga.sample_mean(F.mse_loss(pred, y, reduction='none'))"
        )
    return result[0], result[1]


def _scale_(grads: list[torch.Tensor], factor: float, divide_by: float | None = None) -> None:
    """Multiply (or divide) every gradient in place: one fused foreach kernel where torch
    has it (what its optimizers and clip_grad_norm_ use), else a loop."""
    foreach = getattr(torch, "_foreach_div_" if divide_by is not None else "_foreach_mul_", None)
    same_device = len({(g.device, g.dtype) for g in grads}) == 1
    if foreach is not None and grads and same_device:
        foreach(grads, divide_by if divide_by is not None else factor)
        return
    for g in grads:
        if divide_by is not None:
            g.div_(divide_by)
        else:
            g.mul_(factor)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional; its generator is saved when it is there
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state(
            (
                saved["name"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )


class Accumulator:
    """Runs windows of micro-batches; each window is one exact optimizer step.

    Args:
        model: the module being trained.
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        scheduler: optional learning-rate scheduler; stepped once per optimizer step, never
            on a skipped window.
        max_grad_norm: optional clip on the global norm of the normalized window gradient.
        precision: ``"fp32"`` (no autocast), ``"bf16"`` (autocast) or ``"fp16"`` (autocast and
            a GradScaler, one scaler cycle per window). See ``gradaccum.precision``.
        accumulate_dtype: dtype of the buffers that accumulate low-precision gradients across
            the window's micro-batches; ``"auto"`` (default) is ``torch.float32`` when a
            trainable parameter is bf16 or fp16 and off otherwise; ``None`` turns it off.
        scaler: a ``torch.amp.GradScaler`` to use with ``precision="fp16"`` (for its
            init_scale or growth_interval); by default one is made for the model's device.
        oom_replay: in ``step()``, on ``torch.OutOfMemoryError`` during forward or backward,
            drop the window's gradients, halve the micro-batch size, re-split the same
            window and replay it (every sample once). Off: the error propagates.
        grow_after: clean windows after which a shrunken micro-batch size doubles again,
            up to the size of the micro-batches given (never above).
        fault_hook: called with each micro-batch's size before its forward in ``step()``;
            for tests, e.g. ``ga.memory.inject_oom(16)`` raises OutOfMemoryError above 16.
        noise_scale: estimate the gradient noise scale B_simple from each window's
            micro-batch and window gradients (``gradaccum.noise``); off adds nothing.
        noise_ema: smoothing of the noise-scale estimates (per window).
        sync: for a model wrapped in ``DistributedDataParallel`` or sharded with FSDP2's
            ``fully_shard``: ``"window"`` (default) communicates gradients once per window,
            in the last micro-batch's backward; ``"micro"`` every micro-batch (under FSDP2
            the gradient then stays sharded: less memory, N reduce-scatters per step). The
            window's counts are summed over ranks, so the step is the global batch's. See
            ``gradaccum.sync``. Ignored for a plain model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any | None = None,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        accumulate_dtype: Any = "auto",
        scaler: torch.amp.GradScaler | None = None,
        oom_replay: bool = True,
        grow_after: int = 50,
        fault_hook: Callable[[int], None] | None = None,
        noise_scale: bool = False,
        noise_ema: float = 0.95,
        sync: str = "window",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or not math.isfinite(max_grad_norm)
            or max_grad_norm <= 0
        ):
            raise ValueError(
                f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}"
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")

        self._names = {id(p): n for n, p in model.named_parameters()}
        all_params = list(model.parameters())
        trainable = [p for p in all_params if p.requires_grad]
        if not trainable:
            raise ValueError(
                f"model has no trainable parameters ({len(all_params)} parameters, none with "
                "requires_grad=True); there is nothing to accumulate"
            )
        # Every parameter whose gradient the window produces is normalized and cleared, the
        # optimizer's own extras (a learned loss temperature outside the model) included.
        seen: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in trainable + optimizer_params:
            if id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
        # The gradient that is normalized, measured, clipped and stepped: the optimizer's.
        # A trainable parameter outside the optimizer only has its gradient cleared.
        self._step_params = [p for p in optimizer_params if p.requires_grad]
        self._mp = Precision(
            precision, accumulate_dtype, self._params, trainable[0].device.type, scaler
        )
        self._sync = Sync(model, sync)
        if self._sync.distributed:
            _check_distributed(self._sync, self._mp, noise_scale)

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if fault_hook is not None and not callable(fault_hook):
            raise TypeError(f"fault_hook must be callable, got {type(fault_hook).__name__}")
        self.oom_replay = bool(oom_replay)
        self.oom = OOMPolicy(grow_after=grow_after)
        self._fault_hook = fault_hook
        self.noise: NoiseScale | None = None
        if noise_scale:
            self.noise = NoiseScale(ema=float(noise_ema))
        self.state = AccumulatorState()
        self._window: _Window | None = None
        self._warned_batchnorm = False
        self._pad_source: Any = None  # a micro-batch this rank can replay with weight 0
        self._planned: int | None = None  # micro-batches step() is running in this window

    def __repr__(self) -> str:
        return (
            f"Accumulator({type(self.model).__name__}, {type(self.optimizer).__name__}, "
            f"max_grad_norm={self.max_grad_norm}, precision={self._mp.name!r}, "
            f"accumulate_dtype={self._mp.accumulate_dtype}, state={self.state})"
        )

    @property
    def precision(self) -> str:
        return self._mp.name

    @property
    def accumulate_dtype(self) -> torch.dtype | None:
        return self._mp.accumulate_dtype

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of ``precision="fp16"``, else None."""
        return self._mp.scaler

    # -- one window -------------------------------------------------------------------------

    def step(self, micro_batches: Iterable[Any], loss_fn: LossFn) -> StepResult:
        """Run one window: forward and backward for every micro-batch, then one step.

        ``micro_batches``: an iterable of micro-batches (see ``ga.split``); ``loss_fn(model,
        micro_batch)`` returns ``(loss_sum, count)``.
        """
        if isinstance(micro_batches, (torch.Tensor, Mapping)):
            raise TypeError(
                f"step() takes a sequence of micro-batches, got a {type(micro_batches).__name__};"
                " split a batch first with ga.split(batch, micro_size)"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if self._window is not None:
            raise RuntimeError(
                f"a manual window is open with {self._window.micro_batches} micro-batches; "
                "finish it with end_window() or drop it with abort_window() before step()"
            )
        given = list(micro_batches)
        if self._sync.distributed:
            return self._step_distributed(given, loss_fn)
        if not given:
            raise ValueError("step() got an empty window: a window needs at least one micro-batch")
        replays = 0
        while True:
            run = self.oom.arrange(given)
            try:
                self._run_micro_batches(run, loss_fn)
            except torch.OutOfMemoryError:
                # micro_batch() has dropped the window's gradients. Decide here, replay after
                # the except block: the traceback holds the failed forward's activations.
                if not self.oom_replay or self.oom.shrink(run, self.state.windows + 1) is None:
                    raise
                replays += 1
            else:
                break
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.state.oom_replays += replays
        result = self.end_window()
        if replays == 0:
            self.oom.window_done(given, self.state.windows)
            return result
        return dataclasses.replace(result, oom_replays=replays)

    def _step_distributed(self, given: list[Any], loss_fn: LossFn) -> StepResult:
        """Every rank runs as many micro-batches as the rank that holds the most: collective
        calls (DDP's reduction, FSDP2's all-gathers) must match, or ranks hang. A rank with
        fewer (or none) replays a micro-batch it has seen with loss and count times zero,
        which adds exact zeros. OOM replay is off here: a replay on one rank would change
        its number of micro-batches after the ranks agreed on it."""
        pad = given[-1] if given else self._pad_source
        most, stuck = self._sync.most_micro_batches(len(given), pad is not None)
        if stuck:
            raise ValueError(
                "a rank got an empty window before it ever held a micro-batch, so it has "
                "nothing to run in step with the other ranks; give every rank at least one "
                "micro-batch in its first window (later empty windows are padded)"
            )
        if most == 0:
            raise ValueError(
                "step() got an empty window on every rank: a window needs at least one micro-batch"
            )
        self._pad_source = pad
        for index in range(most):
            real = index < len(given)
            with self.micro_batch(last=index == most - 1):
                loss_sum, count = _unpack(loss_fn(self.model, given[index] if real else pad), index)
                if not real:
                    loss_sum, count = _check_loss(loss_sum, index) * 0.0, 0
                self.backward(loss_sum, count)
        return self.end_window()

    def _run_micro_batches(self, run: list[Any], loss_fn: LossFn) -> None:
        # Micro-batches of one size usually hold equal counts: backward may then pre-divide
        # by the expected total. Sizes that differ would only change the rounding for nothing.
        try:
            equal = len({batch_size(mb) for mb in run}) == 1
        except (TypeError, ValueError):  # micro-batches gradaccum cannot measure
            equal = False
        self._planned = len(run) if equal else None
        try:
            for index, micro_batch in enumerate(run):
                with self.micro_batch():
                    if self._fault_hook is not None:
                        self._fault_hook(batch_size(micro_batch))
                    loss_sum, count = _unpack(loss_fn(self.model, micro_batch), index)
                    self.backward(loss_sum, count)
        finally:
            self._planned = None

    def micro_batch(self, last: bool = False) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch in a hand-written loop; call ``backward`` inside it.

        ``last``: this is the window's last micro-batch. Only a data-parallel model needs it
        (its backward is the one that communicates gradients); every rank must then run the
        same number of micro-batches per window, each marking its last one.

        An exception inside aborts the whole window (gradients cleared, parameters untouched)
        and propagates.
        """
        return _MicroBatch(self, last)

    def backward(self, loss_sum: torch.Tensor, count: int | torch.Tensor) -> None:
        """Backpropagate one micro-batch's summed loss and record its item count."""
        window = self._window
        if window is None or not window.in_micro_batch:
            raise RuntimeError("backward() must be called inside `with acc.micro_batch():`")
        index = window.micro_batches
        if window.backward_done:
            raise RuntimeError(
                f"backward() called twice in micro-batch {index}; add the losses and counts "
                "and call it once"
            )
        loss_sum = _check_loss(loss_sum, index)
        checked = _check_count(count, index)
        self._mp.backward(loss_sum, checked, index == 0, self._params, self._planned)
        if isinstance(checked, torch.Tensor):
            window.tensor_counts.append((index, checked))
        else:
            window.int_count += checked
        if self.noise is not None and not (self._sync.distributed and window.synced_now):
            # (a reduced gradient is not this rank's prefix: the window's global mean is
            # added at end_window instead)
            sums = [
                g for g in (self._mp.accumulated(p) for p in self._step_params) if g is not None
            ]
            multiplier = self._mp.loss_multiplier()
            self.noise.record(total_norm(sums).square() / multiplier**2, checked)
        if loss_sum.is_cpu:
            window.host_loss_sum += loss_sum.item()
        else:
            detached = loss_sum.detach().to(torch.float64)
            window.loss_sum = detached if window.loss_sum is None else window.loss_sum + detached
        window.backward_done = True

    def end_window(self) -> StepResult:
        """Normalize the window's gradient by its count, clip, guard, and step once."""
        window = self._window
        if window is None or window.micro_batches == 0:
            raise ValueError(
                "empty window: no micro-batch ran since the last step; a window needs at least "
                "one micro-batch"
            )
        if window.in_micro_batch:
            raise RuntimeError("end_window() called inside a micro_batch() context")
        try:
            total = window.int_count + self._tensor_count_total(window)
            loss_total = window.host_loss_sum
            if window.loss_sum is not None:
                loss_total += window.loss_sum.item()
            if self._sync.distributed:
                if not window.synced and self._sync.mode == "window":
                    raise RuntimeError(
                        f"the window ended without a micro-batch marked last=True; under "
                        f"{self._sync.kind.upper()} the last micro-batch's backward is the one "
                        "that reduces gradients: use `with acc.micro_batch(last=True)` for it"
                    )
                total, loss_total = self._sync.totals(total, loss_total)
        except BaseException:
            self.abort_window()
            raise

        loss = grad_norm = skipped = None
        try:
            if total == 0:
                skipped = "zero count"
            else:
                loss = loss_total / total
                grads, carried = self._mp.gather(self.optimizer, self._step_params)
                grads = self._sync.local(grads)
                # Pre-divided by the right total already (equal counts): nothing to divide.
                normalized = self._mp.expected == total and self._sync.grad_factor == 1
                # DDP and FSDP2 hand back the mean over ranks: divide by total / world.
                divisor = 1.0 if normalized else total * carried / self._sync.grad_factor
                # The norm of the sum, divided, is the norm of the mean: measuring first lets
                # normalization and clipping share one pass over the gradients.
                grad_norm = self._sync.norm(grads).item() / divisor
                if not math.isfinite(grad_norm):
                    skipped = "fp16 overflow" if self._mp.scaler else "non-finite gradient"
                else:
                    coef = 1.0
                    if self.max_grad_norm is not None:
                        # torch.nn.utils.clip_grad_norm_'s rule, on the normalized gradient.
                        coef = min(1.0, self.max_grad_norm / (grad_norm + 1e-6))
                    if coef < 1.0:
                        _scale_(grads, coef / divisor)
                    elif not normalized:
                        _scale_(grads, 1.0 / divisor, divide_by=divisor)
            b_simple = None
            if self.noise is not None:
                if skipped is None:
                    b_simple = self.noise.end_window(
                        grad_norm**2, total, window_point=self._sync.distributed
                    )
                else:
                    self.noise.drop_window()
            scale = self._mp.scale()
            self._mp.apply(self.optimizer, self._step_params, step=skipped is None)
            if skipped is None and self.scheduler is not None:
                self.scheduler.step()
        except BaseException:
            self.abort_window()
            raise
        self._clear_grads()
        self._window = None

        state = self.state
        state.windows += 1
        state.micro_batches += window.micro_batches
        state.items += total
        if skipped is None:
            state.optimizer_steps += 1
        else:
            state.skipped_windows += 1
            rescaled = f"; loss scale {scale:g} -> {self._mp.scale():g}" if scale else ""
            log.warning(
                "window %d skipped (%s, grad norm %s)%s; %d skipped so far",
                state.windows,
                skipped,
                grad_norm,
                rescaled,
                state.skipped_windows,
            )
        return StepResult(
            loss=loss,
            count=total,
            grad_norm=grad_norm,
            stepped=skipped is None,
            skipped=skipped,
            micro_batches=window.micro_batches,
            step=state.optimizer_steps,
            noise_scale=b_simple,
        )

    def abort_window(self) -> None:
        """Drop the window in progress: clear its gradients; parameters stay as they were."""
        self._mp.abort()
        if self.noise is not None:
            self.noise.drop_window()
        self._clear_grads()
        self._window = None

    def accumulated_gradient(self) -> dict[str, torch.Tensor]:
        """The window's gradient summed so far (not yet divided by the count), by parameter
        name: the fp32 buffer where one is used, else ``.grad``. Read-only; for diagnostics."""
        if self._window is None:
            raise RuntimeError("accumulated_gradient() is only defined inside a window")
        out = {}
        for p in self._params:
            g = self._mp.accumulated(p)
            if g is not None:
                out[self._names.get(id(p), f"param{len(out)}")] = g.detach()
        return out

    @property
    def in_window(self) -> bool:
        """True between a window's first micro-batch and its end."""
        return self._window is not None

    def _open_window(self) -> None:
        if not self._warned_batchnorm:
            self._warned_batchnorm = True
            batchnorm = [
                n
                for n, m in self.model.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
            ]
            if batchnorm:
                log.warning(
                    "%s in train mode: each micro-batch is normalized with its own statistics, "
                    "so accumulation changes the model (not just its batch size). "
                    "gradaccum.diagnose.convert_batchnorm(model) restores exactness; "
                    "gradaccum.check() measures the difference",
                    ", ".join(batchnorm[:3]) + (" ..." if len(batchnorm) > 3 else ""),
                )  # fmt: skip
        for p in self._params:
            if p.grad is not None:
                name = self._names.get(id(p), "an optimizer parameter")
                raise RuntimeError(
                    f"parameter {name} already has a gradient before the window's first "
                    "micro-batch; it would leak into this step. Clear it with "
                    "optimizer.zero_grad(set_to_none=True) before using the Accumulator"
                )
        self._window = _Window()

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    @staticmethod
    def _tensor_count_total(window: _Window) -> int:
        if not window.tensor_counts:
            return 0
        values = torch.stack([c.to(torch.float64) for _, c in window.tensor_counts]).cpu()
        return sum(
            _count_value(value, index)
            for (index, _), value in zip(window.tensor_counts, values.tolist(), strict=True)
        )

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit: model, optimizer,
        scheduler, the accumulator's counters and the random generators. Loadable with
        ``torch.load(..., weights_only=True)``. Only at a window boundary."""
        if self._window is not None:
            raise RuntimeError(
                f"state_dict() called inside a window after {self._window.micro_batches} "
                "micro-batches; checkpoint between windows so a resumed run is the same run"
            )
        if self._sync.kind == "fsdp":
            raise NotImplementedError(
                "state_dict() of an FSDP2-sharded model: save it with "
                "torch.distributed.checkpoint (each rank holds only its shards)"
            )
        return {
            "format": _FORMAT,
            "accumulator": asdict(self.state),
            # The unwrapped module's (no DDP "module." prefix): loads with or without DDP.
            "model": self._sync.inner.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self._mp.scaler is None else self._mp.scaler.state_dict(),
            "oom": self.oom.state_dict(),
            "noise": None if self.noise is None else self.noise.state_dict(),
            "rng": _rng_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict()`` saved; refuses a mismatched checkpoint clearly."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _FORMAT:
            got = (
                state_dict.get("format")
                if isinstance(state_dict, Mapping)
                else type(state_dict).__name__
            )
            raise ValueError(
                f"not a gradaccum Accumulator checkpoint (format {got!r}, expected {_FORMAT!r})"
            )
        if self._window is not None:
            raise RuntimeError(
                "load_state_dict() called inside a window; call abort_window() first"
            )
        keys = ("accumulator", "model", "optimizer", "scheduler", "scaler", "oom", "rng")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"checkpoint is missing {', '.join(missing)}")
        for key, mine in (("scheduler", self.scheduler), ("scaler", self._mp.scaler)):
            if (state_dict[key] is None) != (mine is None):
                has = "has" if state_dict[key] is not None else "has no"
                raise ValueError(
                    f"checkpoint {has} {key} state but this Accumulator has "
                    f"{'one' if mine is not None else 'none'}"
                )
        counters = state_dict["accumulator"]
        known = {f.name for f in fields(AccumulatorState)}
        unknown = set(counters) - known
        if unknown:
            raise ValueError(f"checkpoint has unknown accumulator fields {sorted(unknown)}")
        if self._sync.kind == "fsdp":
            raise NotImplementedError(
                "load_state_dict() into an FSDP2-sharded model: use torch.distributed.checkpoint"
            )
        self._sync.inner.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if self._mp.scaler is not None:
            self._mp.scaler.load_state_dict(state_dict["scaler"])
        self.state = AccumulatorState(**counters)
        self.oom.load_state_dict(state_dict["oom"])
        if self.noise is not None and state_dict.get("noise") is not None:
            self.noise.load_state_dict(state_dict["noise"])
        _set_rng_state(state_dict["rng"])
