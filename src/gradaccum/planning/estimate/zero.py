"""DeepSpeed ZeRO stages 1 and 2 as DeepSpeed's engine holds and runs them, for the estimate's
trace: ``Engine`` stands in for ``deepspeed.initialize``'s engine and its
``DeepSpeedZeroOptimizer`` (deepspeed/runtime/zero/stage_1_and_2.py, 0.19), allocating on the
traced device what they allocate, when they allocate it, on rank 0 of ``world_size`` ranks
(docs/planning.md, "DeepSpeed ZeRO"). The model's forward and backward are traced as they
are; what DeepSpeed adds is modelled:

- The module cast to the run's dtype (``bf16`` / ``fp16`` enabled; else float32), then every
  trainable parameter moved into one flat buffer (padded to a multiple of 2 x the world
  size), each parameter a view of it; the originals freed.
- The float32 master copy of this rank's partition (``P_pad / world`` elements), a separate
  copy also in float32 runs, and the optimizer over it (DeepSpeed's ``FusedAdam``: in place,
  its moments made at the first step).
- Gradients (``contiguous_gradients``, DeepSpeed's default): a hook per parameter copies its
  gradient into a bucket of ``reduce_bucket_size`` elements in the model's dtype (two with
  ``overlap_comm``), made at the first hook of a backward; a full bucket is flattened (a
  copy), reduced, and this rank's slices copied into the gradient partition (the model's
  dtype; a parameter that overlaps the partition is counted whole), made at the first
  reduction. Stage 2 reduces every micro-batch: each one after the first makes a second
  partition, adds it into the first and frees it. Stage 1 keeps autograd's gradients whole
  through the window and reduces at its end. The buckets are freed when a backward ends.
- ``step``: the partition's gradients flattened (a copy in the model's dtype), then cast to
  float32 (another copy, none in float32 runs); the norm read one gradient at a time in
  float64; the optimizer steps the master copy, which is copied back into the flat buffer.

What is refused (one line each, ``refusal``): stage 0 and stage 3, CPU or NVMe offload, a
float32 gradient accumulation (``data_types.grad_accum_dtype``), ``contiguous_gradients``
off.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["ZeroConfig", "Engine", "from_deepspeed"]

_DEFAULT_BUCKET = 500_000_000  # deepspeed/runtime/zero/config.py, reduce_bucket_size
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The DeepSpeed settings that decide ZeRO-1/2's memory. ``precision``: "bf16" or
    "fp16" (DeepSpeed's ``bf16.enabled`` / ``fp16.enabled``: the module cast, no autocast)
    or "fp32"."""

    stage: int = 2
    precision: str = "bf16"
    reduce_bucket_size: int = _DEFAULT_BUCKET
    overlap_comm: bool = False

    def describe(self, world_size: int) -> str:
        return (
            f"DeepSpeed ZeRO stage {self.stage} ({self.precision}, rank 0 of {world_size}): "
            f"the module cast to {self.precision}, its parameters one flat buffer, a float32 "
            "master copy of the rank's partition with the optimizer's state (DeepSpeed's "
            f"FusedAdam, in place); reduce_bucket_size {self.reduce_bucket_size:,} elements"
            f" x {1 + self.overlap_comm} bucket{'s' if self.overlap_comm else ''} "
            f"(overlap_comm {str(self.overlap_comm).lower()}); the gradient partition in "
            f"{self.precision}, flattened and cast to float32 at the step"
        )


def refusal(config: dict[str, Any]) -> str | None:
    """One line for a DeepSpeed configuration this model does not cover, or None."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2):
        return (
            f"DeepSpeed ZeRO stage {stage} is not modelled (stages 1 and 2 are); "
            "the estimate would be wrong, so it is not made"
        )
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            return f"DeepSpeed's {key} to {device} is not modelled (no offload is)"
    accumulate = (config.get("data_types") or {}).get("grad_accum_dtype")
    if accumulate not in (None, "bf16", "fp16", "fp32") or (
        accumulate == "fp32" and _precision(config) != "fp32"
    ):
        return (
            f"DeepSpeed's data_types.grad_accum_dtype {accumulate} is not modelled (gradients "
            "accumulated in the model's dtype, DeepSpeed's default, are)"
        )
    if not zero.get("contiguous_gradients", True):
        return "DeepSpeed's contiguous_gradients false is not modelled (its default, true, is)"
    return None


def _precision(config: dict[str, Any]) -> str:
    for name in ("bf16", "fp16"):
        if (config.get(name) or {}).get("enabled") in (True, "true"):
            return name
    if (config.get("bfloat16") or {}).get("enabled") in (True, "true"):
        return "bf16"
    return "fp32"


def from_deepspeed(
    config: dict[str, Any], *, hidden_size: int | None = None, precision: str | None = None
) -> ZeroConfig:
    """A DeepSpeed configuration (the JSON a run passes as ``--deepspeed``) as ``ZeroConfig``,
    its ``"auto"`` values as Hugging Face's Trainer fills them (transformers/integrations/
    deepspeed.py: ``reduce_bucket_size`` = hidden_size squared; ``bf16``/``fp16`` from the
    run's own precision). Raises ValueError with one line for what is not modelled."""
    if (why := refusal(config)) is not None:
        raise ValueError(why)
    zero = config.get("zero_optimization") or {}
    chosen = _precision(config)
    for name in ("bf16", "fp16"):
        if (config.get(name) or {}).get("enabled") == "auto":
            chosen = precision or "fp32"
    bucket = zero.get("reduce_bucket_size", _DEFAULT_BUCKET)
    if bucket == "auto":
        if hidden_size is None:
            raise ValueError(
                "DeepSpeed's reduce_bucket_size 'auto' is the model's hidden_size squared, "
                "and this model has no config giving one: set it to a number of elements"
            )
        bucket = hidden_size * hidden_size
    overlap = zero.get("overlap_comm", False)
    if overlap == "auto":
        overlap = False
    try:
        bucket = int(float(bucket))
    except (TypeError, ValueError):
        raise ValueError(
            f"DeepSpeed's reduce_bucket_size {bucket!r}: expected a number of elements"
        ) from None
    return ZeroConfig(
        stage=int(zero["stage"]),
        precision=chosen,
        reduce_bucket_size=bucket,
        overlap_comm=bool(overlap),
    )


class Engine:
    """DeepSpeed's engine and ZeRO-1/2 optimizer over ``module`` as they allocate (see the
    module's docstring), driven like ``Accumulator``: ``step(micro_batches, loss_fn)`` runs
    one window. ``tag(tensor, kind)`` names what each storage holds for the estimate."""

    def __init__(self, module, optimizer, config: ZeroConfig, world_size: int, tag) -> None:
        self.module, self.config, self.world, self.tag = module, config, world_size, tag
        self.dtype = _DTYPES[config.precision]
        for p in module.parameters():  # the engine's cast, one parameter at a time
            p.data = p.data.to(self.dtype)
        self.params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        align = 2 * world_size  # nccl_start_alignment_factor x the world size
        padded = math.ceil(total / align) * align
        device = self.params[0].device
        self.flat = torch.empty(padded, dtype=self.dtype, device=device)
        tag(self.flat, "parameters")
        self.offsets, at = [], 0
        for p in self.params:
            self.flat[at : at + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[at : at + p.numel()].view_as(p)
            self.offsets.append(at)
            at += p.numel()
        self.partition = padded // world_size  # rank 0's: [0, partition)
        # the parameters whose elements meet rank 0's partition (the flat buffer's first
        # elements), each counted whole
        self.mine = [i for i, o in enumerate(self.offsets) if o < self.partition]
        self.in_partition = sum(self.params[i].numel() for i in self.mine)
        master = self.flat[: self.partition].clone().float()  # a copy also in float32 runs
        self.master = torch.nn.Parameter(master)
        tag(self.master, "optimizer state")
        self.optimizer = optimizer([self.master])
        self.buckets: list[torch.Tensor] = []
        self.filled = 0
        self.grads: torch.Tensor | None = None  # the partition's accumulated gradient
        self.fresh: torch.Tensor | None = None  # this micro-batch's reduction (stage 2)
        self.micro = 0
        self.waiting: list[torch.nn.Parameter] = []
        self.index = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    # -- backward --------------------------------------------------------------------------

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self.buckets:  # setup_buckets at the first hook of a backward
            count = 1 + self.config.overlap_comm
            self.buckets = [
                torch.empty(self.config.reduce_bucket_size, dtype=self.dtype, device=p.device)
                for _ in range(count)
            ]
            for b in self.buckets:
                self.tag(b, "gradients")
            self.filled = 0
        if self.config.stage == 1:
            self.tag(p.grad, "gradients")
            return  # autograd's gradient kept whole; reduced at the window's end
        n = p.numel()
        if n > self.config.reduce_bucket_size:
            self._reduce([p])  # reduced where it is, not through the bucket
            return
        if self.filled + n > self.config.reduce_bucket_size:
            self._reduce_bucket()
        view = self.buckets[0][self.filled : self.filled + n]
        view.copy_(p.grad.reshape(-1))
        p.grad = view.view_as(p)  # autograd's tensor freed
        self.filled += n
        self.waiting.append(p)

    def _reduce_bucket(self) -> None:
        if self.waiting:
            self._reduce(self.waiting)
        self.waiting, self.filled = [], 0

    def _reduce(self, params: list[torch.nn.Parameter]) -> None:
        """The bucket flattened (a copy), all-reduced, rank 0's slices copied into the
        gradient partition; the other ranks' gradients let go of (stage 2)."""
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        at = 0
        for p in params:
            n, start = p.numel(), self.offsets[self.index[id(p)]]
            if start < self.partition:  # one of rank 0's
                self._partition()[start : start + n].copy_(flat[at : at + n])
            at += n
            p.grad = None
        del flat

    def _partition(self) -> torch.Tensor:
        """The gradient partition this micro-batch's reductions write to, made at the first."""
        first = self.micro == 0 or self.config.stage == 1
        if (self.grads if first else self.fresh) is None:
            made = torch.empty(self.in_partition, dtype=self.dtype, device=self.flat.device)
            self.tag(made, "gradients")
            if first:
                self.grads = made
            else:
                self.fresh = made
        return self.grads if first else self.fresh

    def _end_backward(self) -> None:
        """The backward's epilogue: the last bucket reduced (stage 2), a later micro-batch's
        partition added into the first and freed, the buckets released."""
        if self.config.stage == 1:
            return  # the buckets live to the window's end
        self._reduce_bucket()
        if self.fresh is not None:
            self.grads.add_(self.fresh)
            self.fresh = None
        self.buckets = []

    # -- a window ----------------------------------------------------------------------------

    def step(self, micro_batches: list[Any], loss_fn) -> None:
        self.waiting = []
        for self.micro, batch in enumerate(micro_batches):
            loss, count = loss_fn(self.module, batch)
            (loss / count / len(micro_batches)).backward()  # engine.backward's scaling
            self._end_backward()
        if self.config.stage == 1:  # the window's reduction, in the last epilogue
            self.micro = 0
            for chunk in _chunks(self.params, self.config.reduce_bucket_size):
                self._reduce(chunk)
            self.buckets = []
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        device = self.flat.device
        if self.grads is None:  # no gradient reached the partition
            self.grads = torch.zeros(self.in_partition, dtype=self.dtype, device=device)
        for i in self.mine:  # the norm, one gradient at a time in float64
            start, n = self.offsets[i], self.params[i].numel()
            self.grads[start : start + n].to(torch.float64).norm(2)
        flat = torch.empty(self.partition, dtype=self.dtype, device=device)  # flattened
        n = min(self.partition, self.in_partition)
        flat[:n].copy_(self.grads[:n])
        single = flat.to(torch.float32)
        del flat
        self.grads = None  # the partition's gradient let go of once it is copied
        self.tag(single, "gradients")
        self.master.grad = single
        del single
        self.optimizer.step()
        self.master.grad = None
        self.flat[: self.partition].copy_(self.master.detach())
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None


def _chunks(params: list[torch.nn.Parameter], size: int) -> list[list[torch.nn.Parameter]]:
    out: list[list[torch.nn.Parameter]] = [[]]
    filled = 0
    for p in params:
        if out[-1] and filled + p.numel() > size:
            out.append([])
            filled = 0
        out[-1].append(p)
        filled += p.numel()
    return [c for c in out if c]
