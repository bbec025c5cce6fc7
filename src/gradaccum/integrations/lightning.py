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

With ``ExactAccumulation(oom=OOMReplay())`` and ``Trainer(strategy=OOMReplayStrategy())``,
a micro-batch whose forward or backward runs out of memory drops the window's gradient, and
the window's micro-batches so far (the callback keeps them as Lightning fetches them) run
again at half the size; later micro-batches are split the same way: every sample once, the
same step. One process only. The replay is a strategy's because a callback's hooks run
before and after Lightning's training step and backward, never around them.

A Hugging Face mixture-of-experts model inside the module that adds a router loss to its
own (``output_router_logits=True``) has it trained as its own term of the window: the
window's routing is known only at its end (Lightning fetches a window's micro-batches one
at a time), so at ``on_before_optimizer_step`` the callback runs a pass without gradient
over the window's micro-batches for each expert's share, then each micro-batch's router
term with its backward (``_router_pass``); training_step returns the token loss alone.

With ``ExactAccumulation(schedule=BatchSchedule(...))`` the effective batch follows the
schedule (a ramp, steps, or ``auto`` from B_simple): at each window's first micro-batch the
callback sets ``trainer.accumulate_grad_batches`` to the schedule's window in micro-batches
(``ScheduledWindows``); the schedule's state travels in Lightning's checkpoints.

Refused, with the reason: manual optimization, strategies other than single-device and DDP
(DeepSpeed and FSDP own the reduction and normalization), ``oom=`` without
``OOMReplayStrategy``, a router loss gradaccum cannot count (or under DDP, or with
``oom=``), and a training_step that did not return through ``exact_output``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from gradaccum.batching import batch_size, join_batches
from gradaccum.integrations.adapter import AuditWindow
from gradaccum.integrations.router import router_loss_setting
from gradaccum.integrations.window import FrameworkWindow, ScheduledWindows, noise_option
from gradaccum.loss import routing_counts
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay, free_memory
from gradaccum.schedule import BatchSchedule

__all__ = ["ExactAccumulation", "OOMReplayStrategy", "audit_window", "exact_output"]


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
        self.last: Any = None  # what the last window did (a StepResult)
        self._micro: tuple[Any, Any] | None = None
        self._batches: list[Any] = []  # the window's micro-batches so far, with oom=
        self._replayed = False  # this window replayed
        self.oom_replays = 0  # windows replayed, in all
        self._windows = 0  # windows ended, for the replay's messages
        self._router: Any = None  # the model's router loss as its own term (a RouterTerm)
        self._router_model: torch.nn.Module | None = None  # the model that adds it
        self._tokens: Any = 0  # the window's token count so far, with a router term

    def _take(self, loss_sum: Any, count: Any) -> None:
        self._micro = (loss_sum, count)  # checked when the window takes them, after backward

    # -- what OOMReplayStrategy asks of the window ------------------------------------------

    @property
    def window_batches(self) -> list[Any]:
        """The open window's micro-batches so far, as Lightning fetched them (with ``oom=``)."""
        return list(self._batches)

    @property
    def windows_ended(self) -> int:
        return self._windows

    def drop_window(self, module: torch.nn.Module) -> None:
        """Forget the open window: its gradient, counts, losses and noise prefixes."""
        self._micro = None
        for p in module.parameters():
            p.grad = None
        self.window.drop()

    def count_replay(self) -> None:
        """The open window runs again, smaller (``oom_replays`` is logged)."""
        self.oom_replays += 1
        self._replayed = True

    def on_train_start(self, trainer: lightning.Trainer, pl_module: Any) -> None:
        problems = []
        if not pl_module.automatic_optimization:
            problems.append(
                "manual optimization: the module runs its own backward and step; use "
                "gradaccum's Accumulator inside training_step instead"
            )
        strategy = trainer.strategy
        if type(strategy) not in (SingleDeviceStrategy, DDPStrategy, OOMReplayStrategy):
            problems.append(
                f"strategy {type(strategy).__name__}: only single-device and DDP leave the "
                "gradient's reduction and normalization to Lightning's loop"
            )
        problems.extend(self._router_problems(trainer, pl_module))
        self.window = FrameworkWindow(strategy.model, self.noise)
        if self.oom is not None and self.window.sync.distributed:
            problems.append(
                "oom= replays a window in one process; under DDP the ranks would have to "
                "replay together (gradaccum's Accumulator does that: oom=OOMReplay())"
            )
        elif self.oom is not None and not isinstance(strategy, OOMReplayStrategy):
            problems.append(
                "oom= needs Trainer(strategy=OOMReplayStrategy(device)) from "
                "gradaccum.integrations.lightning: a callback's hooks run before and after "
                "Lightning's training step and backward, never around them, so they cannot "
                "catch an out-of-memory error there and carry on the fit"
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

    def _router_problems(self, trainer: lightning.Trainer, pl_module: Any) -> list[str]:
        """A model inside the module that adds a router loss to its own: trained as its own
        term of the window (the routing pass and the term's gradient at the window's end,
        ``_router_pass``) where its form is known; else why not."""
        self._router = self._router_model = None
        router = router_loss_setting(pl_module)
        if router is None:
            return []
        base = next(
            m
            for m in pl_module.modules()
            if getattr(m, "config", None) is not None and router_loss_setting(m) == router
        )
        from gradaccum.integrations.router import router_term

        term, problem = router_term(base, router[0])
        name = type(base).__name__
        if problem is not None:
            return [f"{problem}, or train it with gradaccum's Accumulator (docs/losses.md)"]
        problems = []
        if type(trainer.strategy) not in (SingleDeviceStrategy, OOMReplayStrategy):
            problems.append(
                f"{name}'s router loss ({router[0]}) under {type(trainer.strategy).__name__}: "
                "its term's gradient is added after the window's last backward, which DDP "
                "has already reduced across ranks; train it in one process, or with "
                "gradaccum's transformers Trainer under torchrun"
            )
        if self.oom is not None:
            problems.append(
                f"oom= with {name}'s router loss: its term's passes would need replaying too; "
                "give one of them"
            )
        self._router, self._router_model = term, base
        return problems

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self.oom is not None or self._router is not None:
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
        if self._router is not None:
            self._tokens = self._tokens + count
        if self.noise is None:
            self.window.add(loss_sum, count)
            return
        # The gradient holds the summed losses / N, times the fp16 loss scale while it lasts.
        multiplier = _loss_scale(trainer) / trainer.accumulate_grad_batches
        self.window.add(loss_sum, count, _grads(pl_module), multiplier)

    def on_before_optimizer_step(
        self, trainer: lightning.Trainer, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        router = None if self._router is None else self._router_pass(trainer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.last = self.window.end(grads, carried=1 / trainer.accumulate_grad_batches)
        if router is not None:  # the window's loss: its token loss, and the router's term
            aux, coefficient = router
            ce = self.last.loss
            loss = None if ce is None else ce + coefficient * aux
            self.last = dataclasses.replace(self.last, loss=loss, terms={"ce": ce, "aux": aux})
            self._batches, self._tokens = [], 0
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

    def _router_pass(self, trainer: lightning.Trainer) -> tuple[float, float]:
        """The router's term of the window, at its end (Lightning fetched its micro-batches
        one at a time, so the window's routing is known only now): a pass without gradient
        over the window's micro-batches for each expert's share of the window's
        assignments, then each micro-batch's term (its router probabilities weighted by
        those shares, ``gradaccum.loss.load_balancing``) backpropagated, weighted so that
        the window's one division gives coefficient x the term's window mean beside the
        token loss's. Returns (the term's window mean, the coefficient)."""
        from gradaccum.integrations.router import router_coefficient, router_inputs

        term, base = self._router, self._router_model
        if not all(isinstance(b, Mapping) for b in self._batches):
            raise TypeError(
                "ExactAccumulation: the router term's passes call the model on the batch's "
                "fields, so each batch must be a mapping of its inputs (input_ids, "
                f"attention_mask), got {type(self._batches[0]).__name__}"
            )
        context = trainer.precision_plugin.train_step_context
        assigned, rows = None, 0.0
        with torch.no_grad(), context():
            for batch in self._batches:
                inputs = router_inputs(base, batch)
                logits = term.logits(base(**inputs))
                a, r = routing_counts(
                    logits, term.experts, term.top_k, inputs.get("attention_mask")
                )
                assigned, rows = (a if assigned is None else assigned + a), rows + r
        coefficient = router_coefficient(base)
        term.begin(assigned, rows, self.window.sync, coefficient)
        # the window's division is by its tokens, times Lightning's 1/N already on the gradient
        weight = (
            coefficient
            * float(self._tokens)
            / (max(float(rows), 1.0) * trainer.accumulate_grad_batches)
        )
        total = None  # the term's sum over the window, on the device until read once
        for batch in self._batches:
            inputs = router_inputs(base, batch)
            with context():
                outputs = base(**inputs)
            aux_sum, _, _ = term.term(outputs, inputs.get("attention_mask"))
            (aux_sum * weight).backward()
            total = aux_sum.detach() if total is None else total + aux_sum.detach()
        term.check()  # the passes routed alike, and the model's aux_loss is of this form
        return float(total) / max(float(rows), 1.0), coefficient

    def state_dict(self) -> dict[str, Any]:
        """Lightning's checkpoints keep the schedule's position and auto's state."""
        return {} if self.schedule is None else {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.schedule is not None and "schedule" in state_dict:
            self.schedule.load_state_dict(state_dict["schedule"])


class OOMReplayStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy with out-of-memory replay for
    ``ExactAccumulation(oom=OOMReplay())``: ``Trainer(strategy=OOMReplayStrategy("cuda:0"),
    callbacks=[ExactAccumulation(oom=...)])``.

    Why a strategy: a callback's hooks run before and after Lightning's training step and
    backward, never around them, so an out-of-memory error there ends the fit before any
    hook could carry on; the strategy's ``training_step`` and ``backward`` are Lightning's
    own override points around them (its docs: "override training_step"). Lightning zeroes
    the gradient between a window's first training step and its backward, so every backward
    here runs inside Lightning's: a micro-batch above the replay's cap has its first piece
    run by Lightning and the rest after that piece's backward; on out-of-memory (in a
    forward, the training step hands Lightning a stand-in loss and the error waits for its
    backward) the window is dropped (``ExactAccumulation.drop_window``) and its micro-batches
    so far run again, split smaller."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[Any] = []  # the micro-batch's pieces after the first
        self.step_args: tuple = ()  # the training step's arguments after the batch
        self.size = 0  # the size of the piece running now
        self.failed: BaseException | None = None  # a forward's error, for the backward

    def callback(self) -> ExactAccumulation | None:
        """The trainer's ``ExactAccumulation`` with ``oom=``, or None (then this strategy is
        Lightning's single-device one)."""
        found = [
            c for c in self.lightning_module.trainer.callbacks if isinstance(c, ExactAccumulation)
        ]
        return found[0] if len(found) == 1 and found[0].oom is not None else None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        callback = self.callback()
        if callback is None or kwargs:
            return super().training_step(*args, **kwargs)
        batch, *rest = args
        first, *self.pending = callback.oom.arrange([batch])
        self.step_args, self.size = tuple(rest), batch_size(first)
        try:
            return super().training_step(first, *rest)
        except torch.OutOfMemoryError as err:
            self.failed = err
        # a stand-in for Lightning to hand its backward, with no graph to the parameters
        return {"loss": torch.zeros((), requires_grad=True, device=self.root_device)}

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        callback = self.callback()
        if callback is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        error, self.failed = self.failed, None
        if error is None:
            try:
                super().backward(closure_loss, optimizer, *args, **kwargs)
                for piece in self.pending:
                    self.size = batch_size(piece)
                    self._forward_backward(piece)
                return closure_loss
            except torch.OutOfMemoryError as err:
                error = err
            finally:
                self.pending = []
        del closure_loss
        self._replay(callback, error)
        return None

    def _forward_backward(self, piece: Any) -> None:
        output = super().training_step(piece, *self.step_args)
        loss = output["loss"] if isinstance(output, Mapping) else output
        trainer = self.lightning_module.trainer
        super().backward(loss / trainer.accumulate_grad_batches, trainer.optimizers[0])

    def _replay(self, callback: ExactAccumulation, error: BaseException) -> None:
        """Drop the window and run its micro-batches so far again, smaller, until they fit;
        the error again when a micro-batch of one does not."""
        while True:
            callback.drop_window(self.lightning_module)
            if callback.oom.shrink(self.size, callback.windows_ended + 1) is None:
                raise error
            error = None
            callback.count_replay()
            free_memory()
            try:
                for piece in callback.oom.arrange(callback.window_batches):
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
AUDIT_FIXES = {
    "mean_per_micro_batch": _EXACT,
    "equal_weights": _EXACT,
    "ragged_window": _EXACT,
    "router_loss": "return the token loss alone through exact_output with gradaccum's "
    "ExactAccumulation(): it adds the model's router loss as its own term of the window "
    "(docs/lightning.md#a-mixture-of-experts-models-router-loss)",
}


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

    def scaled() -> dict[str, float]:
        """Lightning divides every micro-batch's loss by accumulate_grad_batches, a ragged
        window's too (an epoch's last, with fewer micro-batches)."""
        return {"ragged_window": stopped[0] / trainer.accumulate_grad_batches}

    # the window's length is known once it has run
    return AuditWindow(module, window, big, equal, lambda: stopped[0], AUDIT_FIXES, scaled)
