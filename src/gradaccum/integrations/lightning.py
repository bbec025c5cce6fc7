"""Exact gradient accumulation inside Lightning's ``Trainer(accumulate_grad_batches=N)``.

Lightning divides each micro-batch's loss by N and steps after N micro-batches (fewer at an
epoch's end). Over padded or uneven micro-batches that is the mean of means, not the
window's mean, and a ragged last window is under-weighted. With the ``ExactAccumulation``
callback, training_step returns its summed loss and item count through ``exact_output``,
and the gradient handed to clipping and the optimizer is the window's item-mean:

    from gradaccum.integrations.lightning import ExactAccumulation, exact_output

    class LM(lightning.LightningModule):
        def training_step(self, batch, batch_idx):
            loss_sum, count = ga.causal_lm_loss(self(batch["input_ids"]), batch["labels"])
            return exact_output(self, loss_sum, count)  # {"loss": loss_sum, "count": count}

    lightning.Trainer(accumulate_grad_batches=4, callbacks=[ExactAccumulation()])

Why ``exact_output`` and not a plain dict: a callback sees a training_step's outputs only in
``on_train_batch_end``, which for a window's last micro-batch runs after the optimizer has
stepped. ``exact_output`` returns the same dict and hands the count to the callback at once.

At ``on_before_optimizer_step`` (after the last backward and Lightning's fp16 unscaling,
before its clipping) the window's gradient is divided once by its global item count, N
(Lightning's division) undone in the same division (``FrameworkWindow``, the engine's
arithmetic). Under DDP the counts are summed over ranks. B_simple, the gradient noise
scale, is logged with ``self.log("b_simple", ...)``.

With ``ExactAccumulation(oom=OOMReplay())``, a micro-batch whose forward or backward runs
out of memory drops the window's gradient, and the window's micro-batches so far (the
callback keeps them as Lightning fetches them) run again at half the size; later
micro-batches are split the same way: every sample once, the same step. One process only.

With ``ExactAccumulation(schedule=BatchSchedule(...))`` the effective batch follows the
schedule (a ramp, steps, or ``auto`` from B_simple): at each window's first micro-batch the
callback sets ``trainer.accumulate_grad_batches`` to the schedule's window in micro-batches
(``ScheduledWindows``); the schedule's state travels in Lightning's checkpoints.

Refused, with the reason: manual optimization, strategies other than single-device and DDP
(DeepSpeed and FSDP own the reduction and normalization), a model that adds a router loss to
its own (its load-balancing term needs the whole window's routing before the first backward,
and Lightning fetches a window's micro-batches one at a time), and a training_step that did
not return through ``exact_output``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from gradaccum.batching import batch_size
from gradaccum.diagnose.audit import AuditWindow, join_batches
from gradaccum.integrations.window import FrameworkWindow, ScheduledWindows, noise_option
from gradaccum.loss import router_loss_setting
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay, free_memory
from gradaccum.schedule import BatchSchedule

__all__ = ["ExactAccumulation", "audit_window", "exact_output"]


def exact_output(module: lightning.LightningModule, loss_sum: Any, count: Any) -> dict[str, Any]:
    """``{"loss": loss_sum, "count": count}`` for training_step to return, with the count
    handed to the trainer's ``ExactAccumulation`` before backward."""
    if isinstance(loss_sum, Mapping):
        raise TypeError(
            "exact_output takes (loss_sum, count); named terms need each term's count over "
            "the window before its first backward, and Lightning's loop fetches a window's "
            "micro-batches one at a time: use gradaccum's Accumulator (step(..., counts=fn)) "
            "or its transformers Trainer (counts=fn) for a loss of several terms"
        )
    callbacks = [c for c in module.trainer.callbacks if isinstance(c, ExactAccumulation)]
    if len(callbacks) != 1:
        raise RuntimeError(
            f"exact_output needs exactly one ExactAccumulation in the Trainer's callbacks, "
            f"found {len(callbacks)}: Trainer(..., callbacks=[ExactAccumulation()])"
        )
    callbacks[0]._take(loss_sum, count)
    return {"loss": loss_sum, "count": count}


class ExactAccumulation(lightning.Callback):
    """Makes ``accumulate_grad_batches`` exact: the window's gradient is its item-mean.

    Args:
        noise: a ``NoiseScale`` for the gradient noise scale logged as ``b_simple``; True
            (the default) for ``NoiseScale()``, False for none.
        oom: an ``OOMReplay`` to replay a window at a smaller micro-batch size when one runs
            out of memory (every sample once, the same step; ``oom_replays`` is logged), or
            None (the default) to let the error end training.
        schedule: a ``BatchSchedule`` of the effective batch (its ``unit`` a multiple of the
            DataLoader's batch size times the processes); each window's samples are logged
            as ``effective_batch``. None: ``accumulate_grad_batches`` throughout.
    """

    def __init__(
        self,
        noise: NoiseScale | bool = True,
        oom: OOMReplay | None = None,
        schedule: BatchSchedule | None = None,
    ) -> None:
        if oom is not None and not isinstance(oom, OOMReplay):
            raise TypeError(f"oom must be a gradaccum.OOMReplay or None, got {type(oom).__name__}")
        if schedule is not None and not isinstance(schedule, BatchSchedule):
            raise TypeError(
                f"schedule must be a gradaccum.BatchSchedule or None, got {type(schedule).__name__}"
            )
        self.schedule = schedule
        self._scheduled: ScheduledWindows | None = None
        self._window_samples = 0  # this window's samples so far
        self._open = False  # a window has begun and not yet stepped
        self.noise = noise_option(noise)
        self.oom = oom
        self.window: FrameworkWindow | None = None
        self.last: Any = None  # what the last window did (a WindowEnd)
        self._micro: tuple[Any, Any] | None = None
        self._batches: list[Any] = []  # the window's micro-batches so far, with oom=
        self._replayed = False  # this window replayed
        self.oom_replays = 0  # windows replayed, in all
        self._windows = 0  # windows ended, for the replay's messages

    def _take(self, loss_sum: Any, count: Any) -> None:
        self._micro = (loss_sum, count)  # checked when the window takes them, after backward

    def on_train_start(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        problems = []
        if not pl_module.automatic_optimization:
            problems.append(
                "manual optimization: the module runs its own backward and step; use "
                "gradaccum's Accumulator inside training_step instead"
            )
        strategy = trainer.strategy
        if type(strategy) not in (SingleDeviceStrategy, DDPStrategy):
            problems.append(
                f"strategy {type(strategy).__name__}: only single-device and DDP leave the "
                "gradient's reduction and normalization to Lightning's loop"
            )
        router = router_loss_setting(pl_module)
        if router is not None:
            inner = next(
                type(m).__name__
                for m in pl_module.modules()
                if getattr(m, "config", None) is not None and router_loss_setting(m) == router
            )
            problems.append(
                f"{inner} adds a router loss to its own ({router[0]}): its load-balancing term "
                "is a product of two means over the window, exact only from every "
                "micro-batch's routing before the first backward, and Lightning's loop fetches "
                "a window's micro-batches one at a time (nor can the callback see how "
                "training_step uses the model's loss); set output_router_logits=False, or train "
                "it with gradaccum's transformers Trainer or Accumulator (docs/losses.md)"
            )
        self.window = FrameworkWindow(strategy.model, self.noise)
        if self.oom is not None and self.window.sync.distributed:
            problems.append(
                "oom= replays a window in one process; under DDP the ranks would have to "
                "replay together (gradaccum's Accumulator does that: oom=OOMReplay())"
            )
        if self.schedule is not None and any(
            type(c).__name__ == "GradientAccumulationScheduler" for c in trainer.callbacks
        ):
            problems.append(
                "GradientAccumulationScheduler sets accumulate_grad_batches per epoch, and "
                "schedule= sets it per window; give one of them"
            )
        if len(problems) == 1:  # one line
            raise ValueError(f"ExactAccumulation cannot make this run exact: {problems[0]}")
        if problems:
            raise ValueError(
                "ExactAccumulation cannot make this run exact:\n  - " + "\n  - ".join(problems)
            )
        if self.oom is not None:
            _Replaying(self, trainer, pl_module).install()

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self.oom is not None:
            self._batches.append(batch)
        if self.schedule is None:
            return
        if not self._open:  # the window's first micro-batch: its size, and a clean gradient
            if self._scheduled is None:  # the first micro-batch is the DataLoader's size
                world = trainer.world_size
                self._scheduled = ScheduledWindows(self.schedule, batch_size(batch), world)
            trainer.accumulate_grad_batches, _ = self._scheduled.next_window(batch_idx)
            for p in pl_module.parameters():  # Lightning zeroes only at multiples of N
                p.grad = None
            self._open, self._window_samples = True, 0
        self._window_samples += batch_size(batch)

    def on_before_backward(self, trainer: lightning.Trainer, pl_module: Any, loss: Any) -> None:
        if self._micro is None:
            raise RuntimeError(
                "ExactAccumulation: training_step must return exact_output(self, loss_sum, "
                "count) (the count reaches the callback before the optimizer steps)"
            )

    def on_after_backward(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        loss_sum, count = self._micro
        self._micro = None
        if self.noise is None:
            self.window.add(loss_sum, count)
            return
        # The gradient holds the summed losses / N, times the fp16 loss scale while it lasts.
        multiplier = _loss_scale(trainer) / trainer.accumulate_grad_batches
        self.window.add(loss_sum, count, _grads(pl_module), multiplier)

    def on_before_optimizer_step(
        self, trainer: lightning.Trainer, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.last = self.window.end(grads, carried=1 / trainer.accumulate_grad_batches)
        self._windows += 1
        if self.last.b_simple is not None:
            pl_module.log("b_simple", self.last.b_simple, on_step=True, on_epoch=False)
        if self._scheduled is not None:
            self._scheduled.window_done(self.last, self._window_samples)
            self._open = False
            batch = float(self._window_samples * trainer.world_size)
            pl_module.log("effective_batch", batch, on_step=True, on_epoch=False)
        if self.oom is not None:
            if not self._replayed:
                self.oom.window_done(self._batches, self._windows)
            self._batches, self._replayed = [], False
            if self.oom_replays:
                pl_module.log("oom_replays", float(self.oom_replays), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        """Lightning's checkpoints keep the schedule's position and auto's state."""
        return {} if self.schedule is None else {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.schedule is not None and "schedule" in state_dict:
            self.schedule.load_state_dict(state_dict["schedule"])


class _Replaying:
    """Out-of-memory replay around Lightning's own training step and backward (the strategy's
    ``training_step`` and ``backward``, which its loop calls by name). Lightning zeroes the
    gradient between a window's first training step and its backward, so every backward here
    runs inside Lightning's: a micro-batch above the replay's cap has its first piece run by
    Lightning and the rest after that piece's backward; on out-of-memory (in a forward, the
    training step hands Lightning a stand-in loss and the error waits for its backward) the
    window is dropped and its micro-batches so far run again, split smaller."""

    def __init__(self, callback: ExactAccumulation, trainer: Any, module: Any) -> None:
        self.callback, self.trainer, self.module = callback, trainer, module
        strategy = trainer.strategy
        self.step, self.backward = strategy.training_step, strategy.backward
        self.pending: list[Any] = []  # the micro-batch's pieces after the first
        self.args: tuple = ()  # the training step's arguments after the batch
        self.size = 0  # the size of the piece running now
        self.failed: BaseException | None = None  # a forward's error, for the backward

    def install(self) -> None:
        self.trainer.strategy.training_step = self.training_step
        self.trainer.strategy.backward = self.guarded_backward

    def training_step(self, batch: Any, *args: Any) -> Any:
        first, *self.pending = self.callback.oom.arrange([batch])
        self.args, self.size = args, batch_size(first)
        try:
            return self.step(first, *args)
        except torch.OutOfMemoryError as err:
            self.failed = err
        # a stand-in for Lightning to hand its backward, with no graph to the parameters
        return {"loss": torch.zeros((), requires_grad=True, device=self.module.device)}

    def guarded_backward(self, loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        error, self.failed = self.failed, None
        if error is None:
            try:
                self.backward(loss, optimizer, *args, **kwargs)
                for piece in self.pending:
                    self.size = batch_size(piece)
                    self._forward_backward(piece)
                return
            except torch.OutOfMemoryError as err:
                error = err
            finally:
                self.pending = []
        del loss
        self._replay(error)

    def _forward_backward(self, piece: Any) -> None:
        output = self.step(piece, *self.args)
        loss = output["loss"] if isinstance(output, Mapping) else output
        self.backward(loss / self.trainer.accumulate_grad_batches, self.trainer.optimizers[0])

    def _replay(self, error: BaseException) -> None:
        """Drop the window and run its micro-batches so far again, smaller, until they fit;
        the error again when a micro-batch of one does not."""
        callback = self.callback
        while True:
            callback._micro = None
            for p in self.module.parameters():
                p.grad = None
            callback.window.drop()
            if callback.oom.shrink(self.size, callback._windows + 1) is None:
                raise error
            error = None
            callback.oom_replays += 1
            callback._replayed = True
            free_memory()
            try:
                for piece in callback.oom.arrange(callback._batches):
                    self.size = batch_size(piece)
                    self._forward_backward(piece)
                return
            except torch.OutOfMemoryError as err:
                error = err


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _loss_scale(trainer: lightning.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler.get_scale() if scaler is not None else 1.0


# The audit's fixes in Lightning's terms (``gradaccum.diagnose.audit.FIXES`` names them)
_EXACT = (
    "add gradaccum's callback, Trainer(callbacks=[ExactAccumulation()]), and return "
    "exact_output(self, loss_sum, count) from training_step (docs/lightning.md)"
)
AUDIT_FIXES = {"mean_per_micro_batch": _EXACT, "equal_weights": _EXACT}


class _WindowDone(Exception):
    """Raised by the audit's callback at the first optimizer step, to stop the fit there."""


def audit_window(trainer: Any, module: torch.nn.Module, data: Any) -> AuditWindow:
    """``ga.audit``'s window for a Lightning ``Trainer`` with ``accumulate_grad_batches``:
    one window of the trainer's own fit on ``module`` and ``data`` (a DataLoader or a
    LightningDataModule), stopped before its optimizer step; the window's micro-batches,
    recorded as the loop hands them over, joined for the large batch, through
    ``training_step`` (its loss, or ``loss / count`` where it returns ``exact_output``)."""
    seen: list[Any] = []
    stopped = []

    class Capture(lightning.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            stopped.append(len(seen))  # the window's gradient is whole here: stop the fit
            raise _WindowDone

    def window() -> None:
        capture = Capture()
        trainer.callbacks.append(capture)  # last: after any callback that finishes the window
        try:
            if isinstance(data, lightning.LightningDataModule):
                trainer.fit(module, datamodule=data)
            else:
                trainer.fit(module, train_dataloaders=data)
        except _WindowDone:
            pass
        finally:
            trainer.callbacks.remove(capture)
        if not stopped:
            raise ValueError(
                f"the Lightning fit ended after {len(seen)} micro-batches without an optimizer "
                "step; give it at least accumulate_grad_batches batches"
            )

    def mean_loss(batch: Any) -> torch.Tensor:
        out = module.training_step(batch, 0)
        if isinstance(out, Mapping):
            loss = out["loss"]
            return loss / out["count"] if "count" in out else loss
        return out

    def big() -> torch.Tensor:
        return mean_loss(join_batches(seen, {"labels": -100, "attention_mask": 0}))

    def equal() -> torch.Tensor:
        return sum(mean_loss(mb) for mb in seen) / len(seen)

    # the window's length is known once it has run
    return AuditWindow(module, window, big, equal, lambda: stopped[0], AUDIT_FIXES)
