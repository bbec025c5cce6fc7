"""Exact gradient accumulation inside Hugging Face's ``Trainer``.

``Trainer`` here is a drop-in subclass of ``transformers.Trainer``. Keep your
``TrainingArguments`` (``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``max_grad_norm``, ``report_to``); the gradient handed to clipping and the optimizer becomes
the full window's mean over its items, whatever the padding, the micro-batch sizes, a ragged
last window or the ranks' different token counts:

    from gradaccum.integrations.transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)  # as before
    trainer.train()

How: each micro-batch backpropagates its summed loss, unnormalized, and the window's gradient
is divided once by the window's global item count after its last backward, before the
Trainer clips and steps (``FrameworkWindow``, the engine's arithmetic). The Trainer's own
per-micro-batch normalization is switched off (``loss_is_scaled_for_ga = True``).

The loss of a micro-batch, as ``(loss_sum, count)``:
- ``loss_fn(model, inputs)`` when given: your own loss (a sum and its item count).
- a causal LM (its class is one of transformers' causal-LM classes): next-token
  cross-entropy summed over the shifted labels other than -100 (``shift_labels`` from the
  collator when given), counted after the shift.
- a mixture-of-experts causal LM that adds its router loss (``output_router_logits=True``,
  a nonzero coefficient; the classes in ``router._LOAD_BALANCED``): two named terms, the
  next-token cross-entropy and the router's load-balancing term, weighted by the
  coefficient and counted by its routed rows, with the window's share of assignments per
  expert from a pass without gradient over the window before its first backward
  (``RouterTerm``): the model's own loss over the whole window. Refused where that cannot
  be exact (another class, random routing, an ``aux_loss`` of another form).
- any other model with ``labels``: its own loss, a mean over the labels other than -100,
  times that count (refused if it returns an ``aux_loss`` beside it).
- TRL's ``GRPOTrainer``: its clipped surrogate per completion token (and its KL term with
  ``beta``), normalized over the whole window by the gradaccum helper its ``loss_type``
  names: ``dapo`` and ``bnpo`` by ``per_token`` (every token of the window weighs the same;
  bnpo's mean over one micro-batch's tokens is the thing accumulation must not do),
  ``grpo`` by ``per_sequence``, ``dr_grpo`` by ``constant_normalizer`` at
  ``max_completion_length``.
- ``items(inputs)`` when given: the trainer's own training loss (its ``compute_loss``), a
  mean over the micro-batch's items, times their count. TRL's ``DPOTrainer`` takes this
  route by itself, its items being the preference pairs (its per-pair losses only).

With ``oom=OOMReplay()``, a micro-batch that runs out of memory (forward or backward) drops
the window's gradient and replays the window's micro-batches so far at half the size (the
Trainer fetched them up front), then splits the rest of the window the same way: every sample
once, the same step. One process only (under torchrun the ranks would have to replay
together inside the Trainer's synchronized backward).

With ``schedule=BatchSchedule(...)``, the effective batch follows the schedule (a ramp, steps,
or ``auto`` from B_simple): each window fetches the schedule's number of micro-batches, and
``gradient_accumulation_steps`` is set to it so the Trainer steps at the window's end
(``ScheduledWindows``). A resumed run is refused with it: the Trainer skips a resumed epoch's
micro-batches as if every window held ``gradient_accumulation_steps`` of them.

The gradient noise scale (B_simple, see ``gradaccum.noise``) is estimated from each window's
micro-batch prefixes and added as ``b_simple`` to the Trainer's training logs, so it lands
wherever ``report_to`` sends them.

Not supported, refused at ``train()`` with the reason: DeepSpeed and FSDP (they own the
gradient's reduction and normalization), ``torch.nn.DataParallel`` over several GPUs,
``auto_find_batch_size``, ``compute_loss_func``, and a transformers without
``Trainer.loss_is_scaled_for_ga``. ``label_smoothing_factor`` is honored on the model's own
loss (refused with ``loss_fn=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from gradaccum.batching import batch_size, join_batches
from gradaccum.integrations.adapter import AuditWindow
from gradaccum.integrations.router import (
    RouterTerm,
    is_causal_lm,
    router_coefficient,
    router_inputs,
    router_loss_setting,
    router_term,
)
from gradaccum.integrations.trl import (
    RL_NORMALIZATIONS,
    is_preference_trainer,
    is_rl_trainer,
    preference_pairs,
    preference_problems,
    rl_problems,
)
from gradaccum.integrations.window import FrameworkWindow, ScheduledWindows, noise_option
from gradaccum.loss import (
    causal_lm_loss,
    constant_normalizer,
    per_sequence,
    per_token,
    routing_counts,
    token_cross_entropy,
    unpack,
    window_counts,
)
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay, free_memory
from gradaccum.schedule import BatchSchedule

__all__ = [
    "ExactAccumulationMixin",
    "RouterTerm",
    "Trainer",
    "audit_window",
    "preference_pairs",
    "router_coefficient",
    "router_inputs",
    "router_term",
]


@dataclasses.dataclass
class _WindowState:
    """The mixin's open window as the Trainer runs it, in one place (the Trainer calls its
    override points in turn: ``get_batch_samples``, then ``training_step`` and
    ``compute_loss`` once per micro-batch)."""

    epoch_iterator: Any = None  # the epoch whose micro-batches are counted (schedule=)
    epoch_done: int = 0  # micro-batches fetched in this epoch
    batches: list[Any] = dataclasses.field(default_factory=list)  # the window's, as fetched
    size: int = 0  # its micro-batches
    calls: int = 0  # the Trainer's training_step calls in the window so far
    next_counts: dict[str, Any] | None = None  # the next window's counts, with counts=
    counts: dict[str, Any] | None = None  # the open window's counts
    replayed: bool = False  # this window replayed after an out-of-memory error
    micro: tuple[Any] | None = None  # the micro-batch's count, from compute_loss
    pass_size: int | None = None  # the routing pass's micro-batch running now
    last_batch: int | None = None  # the last window's samples, for the logs
    last_b_simple: float | None = None  # the noise scale after the last window
    last_terms: dict[str, float | None] | None = None  # each named term's mean, last window


class ExactAccumulationMixin:
    """Makes a ``transformers.Trainer`` (or any subclass of it) exact: the accumulated
    gradient is the window's item-mean. Put it first: ``class MyTrainer(
    ExactAccumulationMixin, SomeTrainer)``; gradaccum's ``Trainer`` is this mixin over the
    stock one. In training it computes the loss itself (a sum and its count), so a
    subclass's own ``compute_loss`` runs in evaluation only.

    Args (besides the Trainer's own):
        loss_fn: ``loss_fn(model, inputs) -> (loss_sum, count)``, or None for the model's
            own loss (see the module's docstring); or named terms, each its own mean
            (``{"ce": (sum, tokens), "aux": (sum, routed, 0.01)}``), with ``counts``.
        counts: ``counts(inputs) -> {"ce": tokens, "aux": routed}`` for named terms: the
            Trainer fetches a window's micro-batches up front, so each term's count over the
            window (and the ranks) is known before its first backward. Each term's mean is
            logged as ``loss_<name>``.
        items: ``items(inputs) -> int`` when the trainer's own ``compute_loss`` is a mean
            over that many items of the micro-batch (one value per example, averaged): the
            mixin takes that mean times the count. None: TRL's ``DPOTrainer`` counts its
            preference pairs (its batch is the chosen rows, then the rejected); any other
            trainer uses the model's loss (above).
        noise: a ``NoiseScale`` for the gradient noise scale logged as ``b_simple``; True
            (the default) for ``NoiseScale()``, False for none.
        oom: an ``OOMReplay`` to replay a window at a smaller micro-batch size when one
            runs out of memory (every sample once, the same step; ``oom_replays`` joins the
            logs), or None (the default) to let the error end training.
        schedule: a ``BatchSchedule`` of the effective batch (its ``unit`` a multiple of
            ``per_device_train_batch_size`` times the processes); each window's samples are
            logged as ``effective_batch``. None: ``gradient_accumulation_steps`` throughout.
    """

    loss_is_scaled_for_ga = True  # compute_loss returns a sum; the window divides it once

    def __init__(
        self,
        *args: Any,
        loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
        counts: Callable[[Any], Any] | None = None,
        items: Callable[[Any], int] | None = None,
        noise: NoiseScale | bool = True,
        oom: OOMReplay | None = None,
        schedule: BatchSchedule | None = None,
        **kwargs: Any,
    ) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if counts is not None and (not callable(counts) or loss_fn is None):
            raise TypeError(
                "counts must be a function of a micro-batch returning each term's count, "
                "given with a loss_fn that returns those terms"
                f" (got counts={type(counts).__name__}, loss_fn={type(loss_fn).__name__})"
            )
        if items is not None and (not callable(items) or loss_fn is not None):
            raise TypeError(
                "items must be a function of a micro-batch returning how many items the "
                "trainer's own loss averages over, without loss_fn"
                f" (got items={type(items).__name__}, loss_fn={type(loss_fn).__name__})"
            )
        if oom is not None and not isinstance(oom, OOMReplay):
            raise TypeError(f"oom must be a gradaccum.OOMReplay or None, got {type(oom).__name__}")
        self.noise = noise_option(noise)
        super().__init__(*args, **kwargs)
        self.oom = oom
        self.schedule = None
        if schedule is not None:
            world = self.args.world_size
            self.schedule = ScheduledWindows(schedule, self.args.per_device_train_batch_size, world)
        self.oom_replays = 0  # windows replayed, in all
        self.loss_fn, self.counts = loss_fn, counts
        self.items = items
        if items is None and loss_fn is None and is_preference_trainer(self):
            self.items = preference_pairs
        self._rl = is_rl_trainer(self)  # TRL's GRPOTrainer: its loss, normalized over the window
        self._window: FrameworkWindow | None = None
        self._router: RouterTerm | None = None  # the model's router loss, as its own term
        self._resume_from: str | None = None
        self.add_callback(_NoiseCheckpoint(self))
        self._state = _WindowState()  # the open window, as the Trainer runs it

    # -- the window, through the Trainer's documented override points ---------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """The Trainer's ``train``; a resumed run also restores the noise estimate's state
        from the checkpoint it resumes (``gradaccum_noise_<rank>.pt``, written beside it)."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resume_from = resume_from_checkpoint or None
        if self.schedule is not None:
            if self._resume_from:
                raise ValueError(
                    "resuming a run with schedule= is not supported: the Trainer skips a "
                    "resumed epoch's micro-batches as if every window held "
                    "gradient_accumulation_steps of them; train without resuming, or with "
                    "gradaccum's Accumulator and schedule=, which resumes by samples"
                )
            # enough optimizer steps per epoch for the smallest window the schedule runs
            self.args.gradient_accumulation_steps = self.schedule.smallest()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer fetches each window's micro-batches up front: their number is the
        window's size. Its own item count (``num_items_in_batch``) is not used."""
        if self.schedule is not None:  # the schedule's window, ending where the Trainer steps
            if epoch_iterator is not self._state.epoch_iterator:
                self._state.epoch_iterator, self._state.epoch_done = epoch_iterator, 0
            accumulate, num_batches = self.schedule.next_window(self._state.epoch_done)
            self.args.gradient_accumulation_steps = accumulate
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._state.epoch_done += len(batch_samples)
        self._state.size = len(batch_samples)
        self._state.batches, self._state.calls = batch_samples, 0
        if self.counts is not None:  # named terms: each term's count, before any backward
            self._state.next_counts = window_counts(self.counts, batch_samples)
        return batch_samples, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward of one micro-batch's summed loss; after the window's last,
        its gradient divided once by the window's global count. Returns this micro-batch's
        share of the window's mean loss for the Trainer's running loss: zero until the last,
        then the whole window's mean (the Trainer sums them per step)."""
        if self._window is None:
            self._window = self._open(model)
            self._restore_noise()
        window = self._window
        if self._state.calls == 0:
            self._state.counts, self._state.next_counts = self._state.next_counts, None
            self._state.replayed = False
            if self._router is not None:  # the model's router loss: the window's routing first
                self._state.counts = self._route_window(model)
            if self._state.counts is not None:
                window.begin(self._state.counts)
        self._state.calls += 1
        if self.oom is None:
            loss = self._micro_step(model, inputs)
        else:
            loss = self._replaying(model, inputs)
        if self._state.calls < self._state.size:
            return torch.zeros_like(loss)
        if self._router is not None:
            self._router.check()  # before the window's end: the Trainer has not stepped
        end = window.end(self._grads(), scale=self._loss_scale())
        if self.oom is not None and not self._state.replayed:
            self.oom.window_done(self._state.batches, self.state.global_step)
        if self.schedule is not None:
            self._state.last_batch = sum(batch_size(mb) for mb in self._state.batches)
            self.schedule.window_done(end, self._state.last_batch)
        self._state.last_b_simple = end.b_simple
        self._state.last_terms = end.terms
        return torch.full_like(loss, end.loss if end.loss is not None else 0.0)

    def _micro_step(self, model, inputs) -> torch.Tensor:
        """The Trainer's own training_step (forward and backward) of one micro-batch, its
        count recorded in the window."""
        loss = super().training_step(model, inputs, None)
        if self._state.micro is None:
            raise RuntimeError(
                "gradaccum's Trainer: training_step ran without its compute_loss; a subclass "
                "overriding compute_loss must call super().compute_loss(...) in training"
            )
        (count,) = self._state.micro
        self._state.micro = None
        if self.noise is not None:
            self._window.after_backward(count, self._grads(), self._loss_scale())
        return loss

    def _replaying(self, model, inputs) -> torch.Tensor:
        """``_micro_step`` over ``inputs`` split to the replay's cap; on out-of-memory, the
        window's gradient dropped and its micro-batches so far run again, smaller."""
        todo = [inputs]
        while True:
            error, size = None, None
            try:
                for piece in self.oom.arrange(todo):
                    size = batch_size(piece)
                    loss = self._micro_step(model, piece)
            except torch.OutOfMemoryError as err:
                error = err  # its traceback holds the failed pass's tensors: let go below
            if error is None:
                return loss
            self._drop_window()
            if self.oom.shrink(size, self.state.global_step + 1) is None:
                raise error
            error = None
            self.oom_replays += 1
            self._state.replayed = True
            free_memory()
            todo = self._state.batches[: self._state.calls]

    def _drop_window(self) -> None:
        """Forget the open window: its gradient, counts and noise prefixes (parameters and
        the optimizer are untouched until the window's end)."""
        self._state.micro = None
        for p in self.model.parameters():
            p.grad = None
        self._window.drop()
        if self._router is not None:
            self._router.restart()
        if self._state.counts is not None:
            self._window.begin(self._state.counts)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In training: the micro-batch's summed loss (recorded in the window with its count),
        or its named terms combined as the window's counts weigh them. Elsewhere
        (evaluation): the Trainer's own loss, a mean."""
        if not (model.training and self._window is not None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        index = self._window.micro_batches
        outputs = None
        if self.loss_fn is not None:
            loss_sum, count = unpack(self.loss_fn(model, inputs), index)
        elif self._rl:
            loss_sum, count = self._window_normalized_rl_loss(model, inputs)
        elif self.items is not None:  # the trainer's own loss, a mean over the items
            mean = super().compute_loss(model, inputs, return_outputs)
            mean, outputs = mean if return_outputs else (mean, None)
            count = self.items(inputs)
            loss_sum = mean * count
        else:
            loss_sum, count, outputs = self._model_loss(model, inputs)
        loss_sum, count = self._window.record(loss_sum, count)
        self._state.micro = (count,)
        return (loss_sum, outputs) if return_outputs else loss_sum

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Training logs gain ``b_simple``, the gradient noise scale so far, and each named
        term's mean over the last window (``loss_<name>``)."""
        if "loss" in logs and self._state.last_b_simple is not None:
            logs = {**logs, "b_simple": self._state.last_b_simple}
        if "loss" in logs and self._state.last_batch is not None:
            logs = {**logs, "effective_batch": self._state.last_batch * self.args.world_size}
        if "loss" in logs and self.oom_replays:
            logs = {**logs, "oom_replays": self.oom_replays}
        if "loss" in logs and self._state.last_terms:
            logs = {
                **logs,
                **{f"loss_{k}": v for k, v in self._state.last_terms.items() if v is not None},
            }
        super().log(logs, *args, **kwargs)

    # -- helpers --------------------------------------------------------------------------

    def _window_normalized_rl_loss(self, model, inputs) -> tuple[torch.Tensor, Any]:
        """TRL GRPOTrainer's loss of one micro-batch as ``(sum, count)``: its clipped
        surrogate per completion token (log-probabilities from its own
        ``_get_per_token_logps_and_entropies``), plus ``beta`` times its KL estimate, summed
        as its ``loss_type``'s gradaccum normalization counts it."""
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1)
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(logps - (logps.detach() if old is None else old))
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        losses = -torch.min(ratio * advantages, clipped * advantages)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            losses = losses + self.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
        kind = RL_NORMALIZATIONS[self.loss_type]
        if kind == "per_token":
            return per_token(losses, mask)
        if kind == "per_sequence":
            return per_sequence(losses, mask)
        return constant_normalizer(losses, mask, self.max_completion_length)

    def _open(self, model: torch.nn.Module) -> FrameworkWindow:
        """The first training step: refuse what the Trainer cannot do exactly here."""
        problems = []
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append(
                "DeepSpeed and FSDP own the gradient's reduction and normalization; use DDP "
                "(torchrun) or a single process"
            )
        if self.args.n_gpu > 1:
            problems.append(
                f"torch.nn.DataParallel over {self.args.n_gpu} GPUs splits each micro-batch "
                "inside forward; launch one process per GPU with torchrun instead"
            )
        if self.args.auto_find_batch_size:
            problems.append(
                "auto_find_batch_size halves the micro-batch on out-of-memory and with it the "
                "effective batch; plan the micro-batch first (ga.plan(...).export("
                "'transformers'))"
            )
        if getattr(self, "compute_loss_func", None) is not None:
            problems.append(
                "compute_loss_func returns a loss already divided by the Trainer's own item "
                "count, which cannot be read back as a sum; give loss_fn=(model, inputs) -> "
                "(loss_sum, count) instead"
            )
        if self.args.label_smoothing_factor and self.loss_fn is not None:
            problems.append(
                "label_smoothing_factor smooths the model's own loss; with loss_fn= given, "
                "smooth inside it (ga.token_cross_entropy(..., label_smoothing=...))"
            )
        if self.items is preference_pairs:
            problems.extend(preference_problems(self))
        if self._rl and self.loss_fn is None:
            problems.extend(rl_problems(self))
        problems.extend(self._router_problems(model))
        window = FrameworkWindow(model, self.noise)
        if self.oom is not None and window.sync.distributed:
            problems.append(
                "oom= replays a window in one process; under torchrun the ranks would have to "
                "replay together inside the Trainer's synchronized backward (gradaccum's "
                "Accumulator does that: Accumulator(..., oom=OOMReplay()))"
            )
        if self.oom is not None and self.items is preference_pairs:
            problems.append(
                "oom= splits a micro-batch by rows, and a DPOTrainer's rows are its chosen "
                "completions, then its rejected ones; lower per_device_train_batch_size instead"
            )
        if type(self).loss_is_scaled_for_ga is not True or not hasattr(
            transformers.Trainer, "loss_is_scaled_for_ga"
        ):
            problems.append(
                f"transformers {transformers.__version__} has no Trainer.loss_is_scaled_for_ga, "
                "so it would divide each micro-batch's loss again; upgrade transformers"
            )
        if len(problems) == 1:  # one line
            raise ValueError(f"gradaccum's Trainer cannot run exactly here: {problems[0]}")
        if problems:
            raise ValueError(
                "gradaccum's Trainer cannot run exactly here:\n  - " + "\n  - ".join(problems)
            )
        return window

    def _router_problems(self, model: torch.nn.Module) -> list[str]:
        """Whether the model adds a router loss to its own and how it is trained: where the
        mixin computes the model's loss (a causal LM's, no loss_fn or items), as its own term
        of the window (``RouterTerm``) when its form is known and routing is deterministic;
        otherwise the reason it cannot be exact. GRPO and DPO refuse it on their own."""
        self._router = None
        base = self._base_model(model)
        found = router_loss_setting(base)
        if found is None or self.loss_fn is not None or self._rl:
            return []
        if self.items is preference_pairs or self._router_coefficient(base) == 0:
            return []
        setting, name = found[0], type(base).__name__
        if self.items is not None:
            return [
                f"items= takes the trainer's own loss as a mean over items, but {name} adds its "
                f"router loss ({setting}) once per micro-batch; give loss_fn= with it as a named "
                "term (docs/losses.md)"
            ]
        term, problem = router_term(base, setting)
        if problem is not None:
            return [
                f"{problem}, or give loss_fn=(model, inputs) returning it as a named term "
                "(docs/losses.md)"
            ]
        self._router = term
        return []

    def _router_coefficient(self, base: torch.nn.Module) -> float | None:
        """The router loss's coefficient: TRL's trainers keep their own (their config's
        ``router_aux_loss_coef``), else the model's."""
        return router_coefficient(base, self)

    def _route_window(self, model: torch.nn.Module) -> dict[str, Any]:
        """The window's counts before its first backward, for the model's token loss and
        router loss as two terms: the tokens the first counts and the rows the router
        routes, from a pass without gradient over the window's micro-batches (as the
        training forward runs: train mode, the Trainer's autocast, split as ``oom=`` splits
        them), which also gives the router's term the window's share of assignments per
        expert, summed over the ranks. With ``oom=``, a pass that runs out of memory runs
        again, smaller (no gradient yet: nothing to drop)."""
        while True:
            self._state.pass_size = None
            try:
                return self._routing_pass(model)
            except torch.OutOfMemoryError as err:
                error = err  # its traceback holds the failed pass's tensors: let go below
            if (
                self.oom is None
                or self.oom.shrink(self._state.pass_size, self.state.global_step + 1) is None
            ):
                raise error
            error = None
            self.oom_replays += 1
            self._state.replayed = True
            free_memory()

    def _routing_pass(self, model: torch.nn.Module) -> dict[str, Any]:
        router, base = self._router, self._base_model(model)
        run = self.accelerator.unwrap_model(model)  # not DDP's: no collective in the pass
        batches = self._state.batches
        assigned, rows, tokens = None, 0.0, 0
        model.train()
        with torch.no_grad(), self.compute_loss_context_manager():
            for batch in self.oom.arrange(batches) if self.oom is not None else batches:
                self._state.pass_size = batch_size(batch)
                inputs = self._prepare_inputs(batch)
                tokens = tokens + _next_token_count(inputs)
                rest = router_inputs(base, inputs)
                logits = router.logits(run(**rest))
                mask = rest.get("attention_mask")
                a, r = routing_counts(logits, router.experts, router.top_k, mask)
                assigned, rows = (a if assigned is None else assigned + a), rows + r
        router.begin(assigned, rows, self._window.sync, self._router_coefficient(base))
        return {"ce": int(tokens), "aux": float(rows)}

    def _noise_file(self, folder: str) -> Path:
        return Path(folder) / f"gradaccum_noise_{self.args.process_index}.pt"

    def _restore_noise(self) -> None:
        """On a resumed run's first step: the noise estimate as the checkpoint left it."""
        folder = getattr(self, "_resume_from", None)
        if self.noise is None or not folder or not self._noise_file(folder).is_file():
            return
        self.noise.load_state_dict(torch.load(self._noise_file(folder), weights_only=True))

    def _loss_scale(self) -> float:
        """The fp16 loss scale on the gradient until the Trainer unscales it (reading it
        waits for the device, so only the noise estimate and the window's end ask)."""
        scaler = getattr(self.accelerator, "scaler", None)
        return scaler.get_scale() if scaler is not None else 1.0

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _base_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model inside what the Trainer runs (DDP, torch.compile, PEFT)."""
        unwrapped = self.accelerator.unwrap_model(model)
        # torch_compile=True: accelerate keeps torch.compile's module, whose class is not the
        # model's (its loss then counted labels before the shift: 8.5e-3 off)
        unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
        return unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped

    def _model_loss(self, model: torch.nn.Module, inputs: dict[str, Any]):
        """``(loss_sum, count, outputs)`` from the model's own forward; with the model's
        router loss, ``(terms, None, outputs)``: the token loss and the router's term."""
        if "labels" not in inputs:
            raise ValueError(
                "gradaccum's Trainer needs `labels` in every training batch to count items, "
                "or loss_fn=(model, inputs) -> (loss_sum, count); this batch has "
                f"{sorted(inputs)}"
            )
        base = self._base_model(model)
        if is_causal_lm(base):
            # Our own next-token loss from the logits: a sum over the shifted labels that
            # count, whatever loss_type the model declares.
            labels = inputs["labels"]
            shift_labels = inputs.get("shift_labels")
            rest = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
            if self._router is not None:
                rest["output_router_logits"] = True
            outputs = model(**rest)
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            smoothing = self.args.label_smoothing_factor
            if shift_labels is not None:
                loss_sum, count = token_cross_entropy(
                    logits, shift_labels, label_smoothing=smoothing
                )
            else:
                loss_sum, count = causal_lm_loss(logits, labels, label_smoothing=smoothing)
            if self._router is None:
                return loss_sum, count, outputs
            aux = self._router.term(outputs, rest.get("attention_mask"))
            return {"ce": (loss_sum, count), "aux": aux}, None, outputs
        if self.args.label_smoothing_factor:
            # transformers' LabelSmoother on the logits, as a sum over the labels that count
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            if logits.shape[:-1] != inputs["labels"].shape:
                raise ValueError(
                    f"label_smoothing_factor needs logits (..., classes) over the labels' shape "
                    f"{tuple(inputs['labels'].shape)}; this model gives {tuple(logits.shape)}"
                )
            loss_sum, count = token_cross_entropy(
                logits, inputs["labels"], label_smoothing=self.args.label_smoothing_factor
            )
            return loss_sum, count, outputs
        outputs = model(**inputs)
        if isinstance(outputs, dict) and outputs.get("aux_loss") is not None:
            coefficient = self._router_coefficient(base)
            if coefficient is None or coefficient != 0:
                raise ValueError(
                    f"{type(base).__name__} returned an aux_loss beside its loss, which "
                    "gradaccum takes as a mean over the labels: an auxiliary loss it cannot "
                    "count over the window; give loss_fn=(model, inputs) returning it as a "
                    "named term (docs/losses.md)"
                )
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        count = int(inputs["labels"].ne(-100).sum())
        if count == 0:  # the mean over nothing is NaN; nothing to learn from this batch
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
            return logits.sum() * 0.0, 0, outputs
        return loss * count, count, outputs


def _next_token_count(inputs: dict[str, Any]) -> torch.Tensor:
    """The labels a causal LM's next-token loss counts (as ``causal_lm_loss`` and
    ``token_cross_entropy`` count them), from the data alone."""
    shift_labels = inputs.get("shift_labels")
    if shift_labels is not None:
        return (shift_labels != -100).sum()
    return (inputs["labels"][:, 1:] != -100).sum()


class _NoiseCheckpoint(transformers.TrainerCallback):
    """Writes the noise estimate's state into each checkpoint the Trainer saves."""

    def __init__(self, trainer: ExactAccumulationMixin) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        trainer = self.trainer
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if trainer.noise is not None and folder.is_dir():
            torch.save(trainer.noise.state_dict(), trainer._noise_file(str(folder)))
        return control


class Trainer(ExactAccumulationMixin, transformers.Trainer):
    """``transformers.Trainer`` whose accumulated gradient is the window's exact item-mean
    (``ExactAccumulationMixin`` over the stock Trainer)."""


# The audit's fixes in this framework's terms (``gradaccum.diagnose.audit.FIXES`` names them)
AUDIT_FIXES = {
    "mean_per_micro_batch": "put gradaccum's ExactAccumulationMixin first in your Trainer "
    "(class MyTrainer(ExactAccumulationMixin, YourTrainer)) with items=lambda inputs: <the "
    "items your compute_loss averages over>, or loss_fn=(model, inputs) -> (loss_sum, count); "
    "for the stock loss, gradaccum.integrations.transformers.Trainer (docs/transformers.md)",
    "labels_before_shift": "train with gradaccum.integrations.transformers.Trainer (or "
    "ExactAccumulationMixin first in your subclass): it counts a causal LM's labels after "
    "the shift (docs/transformers.md#what-it-computes)",
    "router_loss": "let gradaccum's Trainer compute the model's own loss (no loss_fn=): it "
    "trains the router loss as its own term; a loss_fn= returns it as a named term "
    "(docs/transformers.md#a-mixture-of-experts-models-router-loss)",
    "equal_weights": "put gradaccum's ExactAccumulationMixin first in your Trainer with "
    "items=lambda inputs: <the items your compute_loss averages over>, or loss_fn=(model, "
    "inputs) -> (loss_sum, count) (docs/transformers.md)",
}


def audit_window(trainer: Any) -> AuditWindow:
    """``ga.audit``'s window for a ``transformers.Trainer`` or subclass (TRL's included):
    one window from the trainer's own dataloader, run as its training loop runs it
    (``get_batch_samples``, then ``training_step`` per micro-batch), against the same
    samples as one batch under its own ``compute_loss`` (the first in its class's order
    that is not gradaccum's), a mean. A DPOTrainer's batch is joined pair by pair."""
    if is_rl_trainer(trainer):
        raise TypeError(
            "audit of a GRPOTrainer: its micro-batches are completions it generates inside "
            "training_step, so one window cannot be replayed as one batch; its mixin's "
            "exactness is measured in tests/integration/test_trl.py"
        )
    paired = is_preference_trainer(trainer)  # rows: the chosen completions, then the rejected
    steps = trainer.args.gradient_accumulation_steps
    iterator = iter(trainer.get_train_dataloader())
    batches, items = trainer.get_batch_samples(iterator, steps, trainer.args.device)
    model = trainer.model
    fills = {"labels": -100, "attention_mask": 0}
    pad = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    fills["input_ids"] = pad if pad is not None else 0
    reference = _reference_compute_loss(trainer)
    noise = getattr(trainer, "noise", None)

    def window() -> None:
        saved = None if noise is None else noise.state_dict()
        try:
            # what the training loop sets for each window before its micro-batches
            trainer.current_gradient_accumulation_steps = len(batches)
            for mb in batches:
                trainer.training_step(model, mb, items)
        finally:
            if saved is not None:
                noise.load_state_dict(saved)

    def mean_loss(batch: Any) -> torch.Tensor:
        out = reference(trainer, model, trainer._prepare_inputs(batch))
        return out[0] if isinstance(out, tuple) else out

    def big() -> torch.Tensor:
        if not paired:
            return mean_loss(join_batches(batches, fills))
        halves = [_halves(mb) for mb in batches]  # every chosen row, then every rejected
        return mean_loss(join_batches([h[0] for h in halves] + [h[1] for h in halves], fills))

    def equal() -> torch.Tensor:
        return sum(mean_loss(mb) for mb in batches) / len(batches)

    def scaled() -> dict[str, float]:
        """The trainer divided by ``items`` labels; a causal LM's loss counts the shifted."""
        if items is None or paired or not all(isinstance(b, Mapping) for b in batches):
            return {}
        if not all("labels" in b for b in batches):
            return {}
        counted = float(items.sum() if isinstance(items, torch.Tensor) else items)
        shifted = float(sum(int(_next_token_count(b)) for b in batches))
        return {"labels_before_shift": shifted / counted} if counted else {}

    fixes = AUDIT_FIXES
    if paired:  # the mixin counts a DPOTrainer's preference pairs by itself
        pairs = (
            "put gradaccum's ExactAccumulationMixin first in your DPOTrainer (class ExactDPO("
            "ExactAccumulationMixin, DPOTrainer)): it weighs each micro-batch by its "
            "preference pairs (docs/transformers.md)"
        )
        fixes = {**AUDIT_FIXES, "mean_per_micro_batch": pairs, "equal_weights": pairs}
    return AuditWindow(model, window, big, equal, len(batches), fixes, scaled)


def _reference_compute_loss(trainer: Any) -> Callable[..., Any]:
    """The trainer's own loss, as a mean over a batch: the first ``compute_loss`` in its
    class's order that is not gradaccum's (whose training loss is a sum)."""
    for cls in type(trainer).__mro__:
        if "compute_loss" in vars(cls) and not cls.__module__.startswith("gradaccum."):
            return vars(cls)["compute_loss"]
    raise TypeError(f"{type(trainer).__name__} has no compute_loss")


def _halves(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preference micro-batch's chosen rows and its rejected rows (its first and second
    halves), each a batch of the same keys."""
    parts = {k: v.chunk(2) if isinstance(v, torch.Tensor) else (v, v) for k, v in batch.items()}
    return {k: v[0] for k, v in parts.items()}, {k: v[1] for k, v in parts.items()}
