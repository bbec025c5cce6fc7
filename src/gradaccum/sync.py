"""Gradient communication for a data-parallel model, once per window. All of it lives here.

The Accumulator asks this module four things: whether the model is wrapped for data
parallelism (``DistributedDataParallel``, or FSDP2's ``fully_shard``), whether a micro-batch's
backward communicates, how to make the window's totals global, and the global gradient norm.

Why the last micro-batch communicates and the others do not: DDP all-reduces (and FSDP2
reduce-scatters) gradients inside backward, overlapped with the computation. Suppressing it
on every micro-batch but the window's last one leaves exactly one reduction per optimizer
step, and that one still overlaps with the last backward. The summed gradient is linear, so
reducing the sum once equals reducing every micro-batch's part.

Why the counts are all-reduced: the window's gradient is divided by the items of the whole
*global* batch, and ranks hold different numbers of items (padding, a ragged end). One
all-reduce of ``[count, loss sum]`` per window gives every rank the same divisor. DDP and
FSDP2 average gradients over ranks, so the divisor is the global count over the world size.

``sync="window"`` (the default) reduces once per window. ``sync="micro"`` reduces every
micro-batch: under FSDP2 the gradient then stays sharded between micro-batches (one shard of
every gradient held, against a whole unsharded gradient with ``"window"``) at the price of N
reduce-scatters per step; under DDP it only costs communication and exists for comparisons.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:  # public from torch 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None

__all__ = ["SYNC_MODES", "Sync", "any_rank", "broadcast", "init_from_env", "is_main", "shutdown"]

SYNC_MODES = ("window", "micro")


class Sync:
    """Gradient-sync control for one model: plain (``kind="local"``), DDP or FSDP2."""

    def __init__(self, model: torch.nn.Module, mode: str = "window") -> None:
        if mode not in SYNC_MODES:
            raise ValueError(
                f"sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {mode!r}"
            )
        self.mode = mode
        self.model = model
        self.group = None
        if isinstance(model, DistributedDataParallel):
            self.kind = "ddp"
            self.group = model.process_group
            self.inner = model.module
        elif FSDPModule is not None and isinstance(model, FSDPModule):
            self.kind = "fsdp"
            self.inner = model
        else:
            self.kind = "local"
            self.inner = model
        self.world = dist.get_world_size(self.group) if self.distributed else 1
        self._device = _collective_device(self.group) if self.distributed else torch.device("cpu")

    def __repr__(self) -> str:
        return f"Sync({self.kind}, mode={self.mode!r}, world={self.world})"

    @property
    def distributed(self) -> bool:
        return self.kind != "local"

    @property
    def grad_factor(self) -> int:
        """What the reduced gradient was divided by: DDP and FSDP2 average over ranks."""
        return self.world

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Forward and backward of one micro-batch; they communicate only when ``last`` (or
        in ``"micro"`` mode). DDP decides in forward, FSDP2 in backward: wrap both."""
        if self.kind == "local":
            return contextlib.nullcontext()  # the per-micro-batch path of a plain model
        return self._communicating(last or self.mode == "micro")

    @contextlib.contextmanager
    def _communicating(self, communicate: bool) -> Iterator[None]:
        if self.kind == "ddp":
            before = self.model.require_backward_grad_sync
            self.model.require_backward_grad_sync = communicate
            try:
                yield
            finally:
                self.model.require_backward_grad_sync = before
        else:
            self.model.set_requires_gradient_sync(communicate)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    def _all_reduce(self, values: list[float], dtype: torch.dtype, op) -> list[float]:
        t = torch.tensor(values, dtype=dtype, device=self._device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def most_micro_batches(self, mine: int, can_pad: bool) -> tuple[int, bool]:
        """The largest number of micro-batches any rank holds this window, and whether a rank
        that must pad has nothing to pad with. One small all-reduce (MAX)."""
        most, stuck = self._all_reduce(
            [mine, int(not can_pad and mine == 0)], torch.int64, dist.ReduceOp.MAX
        )
        return int(most), bool(stuck)

    def totals(self, count: int, loss_sum: float) -> tuple[int, float]:
        """Items and loss summed over ranks: one all-reduce of two float64 scalars per window
        (exact for counts below 2**53)."""
        total, loss = self._all_reduce([float(count), loss_sum], torch.float64, dist.ReduceOp.SUM)
        return int(total), loss

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of each gradient (an FSDP2 shard is a DTensor; its local tensor
        shares storage, so scaling it in place scales the gradient)."""
        if self.kind != "fsdp":
            return grads
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    def norm(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradient. DDP gradients are replicated after the reduction
        (bit-identical on every rank), so the local norm is the global one; FSDP2 shards are
        summed as squares over ranks. Non-finite anywhere is non-finite everywhere, so every
        rank takes the same skip and clipping decision."""
        norm = total_norm(local_grads)
        if self.kind != "fsdp":
            return norm
        squared = norm.double().square().to(self._device)
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()


def _collective_device(group=None) -> torch.device:
    """Where a group's collectives take their tensors: the current GPU for nccl, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors, at least fp32 for the sum of squares."""
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    same = len({(g.device, g.dtype) for g in grads}) == 1 and grads[0].dtype in (
        torch.float32,
        torch.float64,
    )
    if same and hasattr(torch, "_foreach_norm"):
        # One fused kernel per device, what clip_grad_norm_ runs, without its Python wrapper
        # (about 50 us a call, measured).
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    norms = [torch.linalg.vector_norm(g, dtype=dtype).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


# -- the processes of a torchrun job (used by `gradaccum train`) -----------------------------


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK): nccl on CUDA, gloo on CPU. Returns ``(rank,
    world)``; ``(0, 1)`` when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    """Rank 0 of a process group, or a process outside one: the one that speaks."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast(value, src: int = 0):
    """Rank ``src``'s value on every rank (a small picklable object between the job's own
    processes: a path, a verdict, a plan)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (e.g. a signal that reached one rank)."""
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
