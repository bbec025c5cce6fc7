"""Pipeline parallelism with exact accumulation: the window's micro-batches are the pipeline's.

A model too deep for one device is cut into stages, one per process, and a batch streams
through them as micro-batches (``torch.distributed.pipelining``: ``PipelineStage`` and its
schedules, GPipe and 1F1B). Its default loss handling has the flaw this library exists to
remove: each micro-batch's loss is a mean and the gradients are divided by the number of
micro-batches, so micro-batches of padded sequences with different token counts are
weighted wrongly.

``PipelineWindow`` runs the schedule with summed losses (``scale_grads=False``): every
stage's gradient is then the sum over the window's items. The last stage's loss function
returns ``(loss_sum, count)``; the window's count reaches every stage in one all-reduce of
two numbers, and each stage divides its gradient once by it, clips by the global norm over
all stages (the sum of their squares) and steps, or every stage skips when the norm is not
finite anywhere. That is ``window.Tally`` and ``window.Closing.close`` over ``PipelineSync``:
the Accumulator's own end of a window (its skip policy, its warning, the scheduler's step,
the noise estimate), not a copy of it.

Precision is the Accumulator's ``Precision``: bf16 and fp16 autocast each stage's forward and
the loss (not the backward, as in one process); under fp16 the last stage's loss carries the
window's pre-scale and the loss scale, the pre-scale reaches the other stages, and the loss
scaler is torch's ``ShardedGradScaler`` over the pipeline's group: an overflow on any stage
skips the window on every stage and lowers the one scale they share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradaccum.checkpoint import check_state, saved_state, set_rng_state
from gradaccum.precision import Precision
from gradaccum.sync import PipelineSync, collective_device
from gradaccum.window import (
    AccumulatorState,
    Closing,
    SkipNonFinite,
    SkipPolicy,
    StepResult,
    Tally,
    total_norm,
)

__all__ = [
    "SCHEDULES",
    "ChainedStages",
    "PipelineWindow",
    "chain",
]

SCHEDULES = ("gpipe", "1f1b")
FORMAT = "gradaccum.pipeline-stage/1"


class PipelineWindow:
    """One stage's side of exact windows through a pipeline schedule.

    ``stage``: this process's ``torch.distributed.pipelining.PipelineStage``; ``optimizer``:
    over its parameters; ``loss_fn(output, target) -> (loss_sum, count)``: used on the last
    stage (a loss summed over the micro-batch's items and how many there are);
    ``micro_batches``: the window's micro-batches (the schedule cuts the batch along dim 0);
    ``schedule``: "gpipe" or "1f1b"; ``max_grad_norm``: clip to this global norm; ``group``:
    the pipeline's process group (default: the world); ``tied``: parameters this stage
    shares with another (a head tied to the first stage's embedding: the first and the last
    stage each pass their copy, the others nothing): their gradients are summed over the two
    stages, counted once in the norm, and both copies take the same step; ``precision``:
    ``"fp32"``, ``"bf16"`` or ``"fp16"`` (or a ``Precision``; its fp16 scaler, if given, a
    ``ShardedGradScaler`` over ``group``), with fp32 parameters: the schedule runs every
    micro-batch's backward inside one call, so there is no moment to move a low-precision
    gradient into an fp32 buffer. ``scheduler``: stepped once per optimizer step, never on a
    skipped window; ``noise``: a ``NoiseScale``, its prefixes taken as each micro-batch's
    backward begins on this stage (their squared norms summed over the stages once per
    window); ``skip``: the skip policy (``SkipNonFinite()``), as the Accumulator's.

    ``state`` counts windows and steps as the Accumulator's does; ``state_dict()`` is this
    stage's part of a checkpoint (its module, optimizer, counters and random generators).
    """

    def __init__(
        self,
        stage: Any,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], tuple[torch.Tensor, Any]],
        micro_batches: int,
        *,
        schedule: str = "gpipe",
        max_grad_norm: float | None = None,
        group: Any = None,
        tied: Sequence[torch.nn.Parameter] = (),
        precision: str | Precision = "fp32",
        scheduler: Any = None,
        noise: Any = None,
        skip: SkipPolicy | None = None,
    ) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if (
            isinstance(micro_batches, bool)
            or not isinstance(micro_batches, int)
            or micro_batches < 1
        ):
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self._params = [p for group_ in optimizer.param_groups for p in group_["params"]]
        device_type = self._params[0].device.type
        self.precision = Precision.of(precision)
        if self.precision.name == "fp16" and self.precision.scaler is None:
            # One scale for every stage: found_inf is all-reduced over the group in unscale_.
            self.precision.scaler = ShardedGradScaler(device_type, process_group=group)
        if self.precision.scaler is not None and not isinstance(
            self.precision.scaler, ShardedGradScaler
        ):
            raise ValueError(
                "precision='fp16' through a pipeline needs a ShardedGradScaler over the "
                "pipeline's group (each stage sees only its own overflow), got "
                f"{type(self.precision.scaler).__name__}"
            )
        self.precision.bind(self._params, device_type)
        if self.precision.accumulate_dtype is not None:
            raise ValueError(
                f"{self.precision!r} through a pipeline: the schedule runs every micro-batch's "
                "backward inside one call, so low-precision gradients cannot be moved into "
                "fp32 buffers between them; keep fp32 parameters (autocast computes in "
                f"{self.precision.name})"
            )
        self.stage, self.optimizer, self.loss_fn = stage, optimizer, loss_fn
        self.micro_batches, self.max_grad_norm = micro_batches, max_grad_norm
        self.sync = PipelineSync(group)
        self.group, self.schedule_name = group, schedule
        self.state = AccumulatorState()
        self.scheduler, self.noise = scheduler, noise
        self.skip = SkipNonFinite() if skip is None else skip
        self._tied = list(tied)
        if self._tied and not (stage.is_first or stage.is_last):
            raise ValueError("tied parameters are the first and the last stage's copies")
        if self._tied and stage.is_first and stage.is_last:
            raise ValueError("tied parameters need two stages: this one is the only one")
        if self._tied and noise is not None:
            raise ValueError(
                "noise= with tied parameters: a prefix's norm needs the two copies' gradients "
                "summed, which happens once per window, after the schedule"
            )
        self._prefixes: list[torch.Tensor] = []  # squared norms as each backward begins
        self._losses: list[tuple[torch.Tensor, Any]] = []  # the last stage's, this window
        self._tally = Tally()  # this window's numbers (begun with the counts of named terms)
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        # Summed losses, no division by the number of micro-batches: the gradient each stage
        # holds after the schedule is the window's sum over its items.
        self.schedule = kind(stage, micro_batches, loss_fn=self._loss, scale_grads=False)
        self._autocasts: list[Any] = []  # the open autocast of a stage forward, in step()
        self._in_step = False
        if self.precision.autocast_dtype is not None:
            stage.submod.register_forward_pre_hook(self._enter_autocast)
            stage.submod.register_forward_hook(self._leave_autocast, always_call=True)
        if noise is not None:
            stage.submod.register_forward_hook(self._watch_backward)
        # The last stage's copies of tied parameters are left out of the norm and the
        # division: the first stage's copy holds their summed gradient and is sent back.
        tied_ids = {id(p) for p in self._tied} if stage.is_last else set()
        self._counted = [p for p in self._params if id(p) not in tied_ids]
        # The pipeline group's ranks of the first and the last stage, for the tied copies.
        self._first, self._last = (
            dist.get_global_rank(group, r) if group is not None else r
            for r in (0, stage.num_stages - 1)
        )

    def _enter_autocast(self, module: torch.nn.Module, args: Any) -> None:
        """The stage's forward under autocast while a window runs (evaluation stays fp32, as
        in one process); the backward runs outside it."""
        if self._in_step:
            context = self.precision.autocast()
            context.__enter__()
            self._autocasts.append(context)

    def _leave_autocast(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._autocasts:
            self._autocasts.pop().__exit__(None, None, None)

    def _watch_backward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A micro-batch's backward on this stage begins where its output's gradient
        arrives; stages run their micro-batches' backwards in order (GPipe and 1F1B), so the
        gradient then is the sum over the micro-batches before it: a prefix."""
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        first = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if self._in_step and first is not None:
            first.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        grads = self._grads()
        if grads:  # the first backward finds none: no prefix before it
            self._prefixes.append(total_norm(grads).square())

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        with self.precision.autocast():
            result = self.loss_fn(output, target)
        if isinstance(result, Mapping):  # named terms: weighed by the window's counts
            loss_sum, count = self._tally.combine(result, len(self._losses))
            self._losses.append((result, None))
        else:
            loss_sum, count = result
            self._losses.append((loss_sum, count))
        # fp16: the pre-scale from the first loss the schedule computes in this window.
        return self.precision.scaled(loss_sum, count, first=len(self._losses) == 1)

    def step(self, *inputs: Any, target: Any = None, counts: Any = None) -> StepResult:
        """One window: the first stage passes the batch's inputs, the last its targets (every
        stage may pass both; each uses its own). Every stage returns the same global loss per
        item, count, norm and decision.

        ``counts(target) -> {"ce": tokens, ...}``: for a ``loss_fn`` that returns named terms,
        each term's count over the window's whole target (it must add up over rows: a sum
        over the micro-batches the schedule cuts). Every stage passes ``target`` and
        ``counts``: the last stage counts, the others name the terms with no items."""
        args = inputs if self.stage.is_first else ()
        self._losses, self._prefixes = [], []
        tally = self._tally = Tally()  # the last stage's losses; the others learn the count
        if counts is not None:
            if target is None:
                raise ValueError(
                    "counts= needs target= on every stage: the last stage counts the terms, "
                    "the others name them with no items"
                )
            given = dict(counts(target))
            tally.begin(given if self.stage.is_last else dict.fromkeys(given, 0), self.sync)
        self._in_step = True
        try:
            if self.stage.is_last:
                self.schedule.step(*args, target=target)
            else:
                self.schedule.step(*args)
        finally:
            self._in_step = False
        window_counts = [0] * self.micro_batches
        if self.stage.is_last:
            # The schedule's first step also calls the loss once to infer the backward's
            # shapes: the window's micro-batches are the last ones it computed.
            if len(self._losses) < self.micro_batches:
                raise RuntimeError(
                    f"the schedule computed {len(self._losses)} losses for "
                    f"{self.micro_batches} micro-batches"
                )
            for i, (loss_sum, count) in enumerate(self._losses[-self.micro_batches :]):
                window_counts[i] = tally.add(loss_sum, count)[1]
        self._tied_grads(sum_to_first=True)
        # fp16: unscale_ (the stages' overflow agreed), and the pre-scale the last stage's
        # losses carried, which every stage divides out with the count.
        if self.precision.scaler is not None and not self.stage.is_last:
            # The scale lives where a loss was scaled: on the other stages, made here (its
            # value the one they share) so that unscale_ finds it.
            self.precision.scaler.scale(torch.zeros((), device=self._params[0].device))
        if self.noise is not None:  # the whole window's prefix, before unscale_
            self._prefixes.append(total_norm(self._grads()).square())
        grads, prescale = self.precision.gather(self.optimizer, self._counted)
        carried = self._carried(prescale)
        if self.noise is not None:
            self._add_prefixes(window_counts, carried * (self.precision.scale() or 1.0))

        def apply(step: bool) -> None:
            if step:
                self._tied_grads(sum_to_first=False)  # the divided, clipped gradient, both copies
            self.precision.apply(self.optimizer, self._params, step=step)

        closing = Closing(
            self.sync,
            self.state,
            self.max_grad_norm,
            self.skip,
            self.noise,
            self.scheduler,
            self.precision,
        )
        result = closing.close(tally, lambda: (grads, carried), apply)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _add_prefixes(self, counts: list[Any], multiplier: float) -> None:
        """The window's prefixes into the noise estimate: each stage's squared norms as each
        backward began and at the window's end, summed over the stages, with the last
        stage's micro-batch counts (one all-reduce); the loss ``multiplier`` (fp16's
        pre-scale and loss scale) divided out."""
        if len(self._prefixes) != self.micro_batches:
            raise RuntimeError(
                f"the noise estimate saw {len(self._prefixes)} backwards for "
                f"{self.micro_batches} micro-batches on this stage"
            )
        summed = self.sync.sum([*self._prefixes, *counts])
        n = self.micro_batches
        for sq, count in zip(summed[:n], summed[n:], strict=True):
            value = torch.tensor(sq / multiplier**2, dtype=torch.float64)
            self.noise.add_prefix(value, round(count))

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._counted if p.grad is not None]

    @property
    def steps(self) -> int:
        return self.state.optimizer_steps

    def _carried(self, prescale: float) -> float:
        """The pre-scale on the window's gradient (fp16): the last stage's, on every stage."""
        if self.precision.scaler is None:
            return prescale
        value = torch.tensor([prescale], dtype=torch.float64, device=collective_device(self.group))
        dist.broadcast(value, self._last, group=self.group)
        return float(value.item())

    def _tied_grads(self, sum_to_first: bool) -> None:
        """Before the window ends, the last stage's gradients of the tied parameters are added
        to the first stage's; after it, the first stage's result replaces the last's."""
        if not self._tied:
            return
        sender = self.stage.is_last if sum_to_first else self.stage.is_first
        peer = self._first if self.stage.is_last else self._last
        for p in self._tied:
            if p.grad is None:  # unused in this window: its gradient is zero
                p.grad = torch.zeros_like(p)
            if sender:
                dist.send(p.grad, peer)
            elif sum_to_first:
                other = torch.empty_like(p.grad)
                dist.recv(other, peer)
                p.grad.add_(other)
            else:
                dist.recv(p.grad, peer)

    def state_dict(self) -> dict[str, Any]:
        """This stage's part of a checkpoint, between windows: its module's parameters, the
        optimizer, the scheduler and noise estimate (when given), the counters and the random
        generators (``torch.load(..., weights_only=True)`` reads it)."""
        return saved_state(
            FORMAT,
            self.state,
            self.precision.scaler,
            stage=self.stage.stage_index,
            stages=self.stage.num_stages,
            model=self.stage.submod.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scheduler=None if self.scheduler is None else self.scheduler.state_dict(),
            noise=None if self.noise is None else self.noise.state_dict(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved on this stage; refuses another stage's."""
        parts = ("stage", "stages", "model", "optimizer")
        held = {"scaler": self.precision.scaler}
        check_state(state_dict, FORMAT, "pipeline stage", AccumulatorState, parts, held)
        where = (state_dict["stage"], state_dict["stages"])
        if where != (self.stage.stage_index, self.stage.num_stages):
            raise ValueError(
                f"checkpoint of stage {where[0]} of {where[1]} loaded into stage "
                f"{self.stage.stage_index} of {self.stage.num_stages}"
            )
        self.stage.submod.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(state_dict["scaler"])
        # The scheduler's and the noise estimate's state when both sides have one (a stage
        # checkpoint written before the pipeline took them has neither).
        for policy, key in ((self.scheduler, "scheduler"), (self.noise, "noise")):
            if policy is not None and state_dict.get(key) is not None:
                policy.load_state_dict(state_dict[key])
        self.state = AccumulatorState(**state_dict["accumulator"])
        set_rng_state(state_dict["rng"])


def chain(module: torch.nn.Module, x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The stages' forward chained across the pipeline's processes, without a schedule (for
    evaluation, under ``torch.no_grad``): every stage calls it with the same input, stage k
    runs on stage k-1's output, and the last stage's output comes back to every stage.
    Outputs are float32 tensors of up to 8 dimensions."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    last, device = size - 1, x.device

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    def header(t: torch.Tensor | None) -> torch.Tensor:
        """A tensor's shape in 9 numbers (its dimensions, then its sizes): what the receiving
        side allocates from."""
        out = torch.zeros(9, dtype=torch.long, device=device)
        if t is not None:
            out[0] = t.dim()
            out[1 : 1 + t.dim()] = torch.tensor(t.shape)
        return out

    def allocate(shape: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape[1 : 1 + int(shape[0])].tolist(), device=device)

    if rank > 0:
        shape = header(None)
        dist.recv(shape, peer(rank - 1))
        x = allocate(shape)
        dist.recv(x, peer(rank - 1))
    y = module(x).float().contiguous()
    if rank < last:
        dist.send(header(y), peer(rank + 1))
        dist.send(y, peer(rank + 1))
    # The last stage's output to every stage: its shape first, then the values.
    shape = header(y if rank == last else None)
    dist.broadcast(shape, peer(last), group=group)
    out = y if rank == last else allocate(shape)
    dist.broadcast(out, peer(last), group=group)
    return out


class ChainedStages(torch.nn.Module):
    """A pipeline's stages as one model for evaluation: every stage calls it with the same
    ids and gets the last stage's logits (``gradaccum.pipeline.chain``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return chain(self.module, ids)
