"""Gradient communication for a data-parallel model, once per window. All of it lives here.

The Accumulator asks this module whether the model is wrapped for data parallelism
(``DistributedDataParallel``, or FSDP2's ``fully_shard``), whether a micro-batch's backward
communicates, how to make the window's totals global, the global gradient norm, and how to
pad a rank that holds fewer micro-batches than the others.

Why the last micro-batch communicates and the others do not: DDP all-reduces (and FSDP2
reduce-scatters) gradients inside backward, overlapped with the computation. Suppressing it
on every micro-batch but the window's last one leaves exactly one reduction per optimizer
step, and that one still overlaps with the last backward. The summed gradient is linear, so
reducing the sum once equals reducing every micro-batch's part.

Why a forward must run inside ``micro_batch()``: DDP decides in its forward whether the
backward that follows communicates. A loss computed outside the context and backpropagated
inside would reduce on the wrong micro-batch and leave the ranks' gradients different, so
the Accumulator refuses it.

Why the counts are all-reduced: the window's gradient is divided by the items of the whole
*global* batch, and ranks hold different numbers of items (padding, a ragged end). One
all-reduce of ``[count, loss sum]`` per window gives every rank the same divisor. DDP and
FSDP2 average gradients over ranks, so the divisor is the global count over the world size.

When the window's sums do not live in ``.grad`` for the whole window, DDP's reduction inside
the last backward would miss them, so under DDP the Accumulator reduces the window's sums
itself, once, at the window's end (``reduce_at_end``): with fp32 accumulation buffers for
low-precision parameters (the reduction then sums fp32 buffers, the window's whole sum), and
with OOM replay (no collective runs inside a micro-batch, so a rank that runs out of memory
midway leaves nothing for the others to wait on; one small all-reduce after the window says
whether any rank did, and all of them replay it). The price is that this one reduction no
longer overlaps the last backward. Under FSDP2 every forward gathers parameters across
ranks, so a rank cannot leave a micro-batch midway: OOM replay is refused there, and fp32
accumulation is FSDP2's own ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, which
accumulates the unsharded gradient in fp32 between micro-batches and reduce-scatters it so.

``sync="window"`` (the default) reduces once per window. ``sync="micro"`` reduces every
micro-batch: under FSDP2 the gradient then stays sharded between micro-batches (one shard of
every gradient held, against a whole unsharded gradient with ``"window"``) at the price of N
reduce-scatters per step; under DDP it only costs communication and exists for comparisons.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradaccum.batching import map_tensors
from gradaccum.window import total_norm

try:  # public from torch 2.6; torch 2.4 and 2.5 (which the package supports) keep it here
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch < 2.6
    from torch.distributed._composable.fsdp import FSDPModule

__all__ = ["SYNC_MODES", "Sync", "collective_device", "kind_of"]

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
        self.inner = model
        self.kind = kind_of(model)
        if self.kind == "ddp":
            self.group, self.inner = model.process_group, model.module
        self.distributed = self.kind != "local"
        self.world = dist.get_world_size(self.group) if self.distributed else 1
        self._device = collective_device(self.group) if self.distributed else None
        self._pad: Any = None  # one sample of a micro-batch this rank held, to pad with
        self._forwards: int | None = None  # forwards in the micro-batch in progress
        self.reduce_at_end = False  # DDP: the Accumulator reduces the window's sums (configure)
        if self.distributed:
            ref = weakref.ref(self)

            def count_forward(module: torch.nn.Module, args: Any) -> None:
                sync = ref()
                if sync is not None and sync._forwards is not None:
                    sync._forwards += 1

            handle = model.register_forward_pre_hook(count_forward)
            weakref.finalize(self, handle.remove)

    @classmethod
    def pipeline(cls, group: Any = None) -> Sync:
        """The stages of one pipeline (``torch.distributed.pipelining``): each holds its own
        parameters, so the norm sums squares over the stages as over FSDP2's shards; nothing
        averages a gradient over them (``world`` 1 for the divisor); the last stage alone
        knows the counts, which ``totals`` sums over the group."""
        sync = cls.__new__(cls)
        sync.mode, sync.model, sync.inner = "window", None, None
        sync.kind, sync.group, sync.distributed, sync.world = "pipeline", group, True, 1
        sync._device = collective_device(group)
        sync._pad, sync._forwards, sync.reduce_at_end = None, None, False
        return sync

    def __repr__(self) -> str:
        return f"Sync({self.kind}, mode={self.mode!r}, world={self.world})"

    def configure(self, precision: Any, oom: Any, noise: Any) -> None:
        """Decide where the window's gradient is reduced (``reduce_at_end``), and refuse what
        the data-parallel path does not do, at once, with the reasons."""
        if not self.distributed:
            return
        accumulate_dtype, fp16 = precision.accumulate_dtype, precision.scaler is not None
        self.reduce_at_end = self.kind == "ddp" and (
            accumulate_dtype is not None or oom is not None
        )
        problems = []
        if self.kind == "fsdp" and accumulate_dtype is not None:
            problems.append(
                f"accumulate_dtype={accumulate_dtype}: FSDP2 reduces inside backward and "
                "accumulates in its own reduce dtype; give fully_shard "
                "mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32) instead"
            )
        if self.kind == "fsdp" and fp16:
            problems.append(
                "precision='fp16' under FSDP2: each rank would see only its shards' overflow; "
                "use precision='bf16'"
            )
        if self.kind == "fsdp" and oom is not None:
            problems.append(
                "oom=OOMReplay(...) under FSDP2: every forward gathers parameters across "
                "ranks, so a rank that runs out of memory midway leaves the others waiting; "
                "pass oom=None"
            )
        if self.reduce_at_end and self.mode == "micro":
            why = "fp32 accumulation buffers" if accumulate_dtype is not None else "OOM replay"
            problems.append(
                f"sync='micro' with {why} under DDP: the window's sum is then reduced once, at "
                "its end; use sync='window'"
            )
        if noise is not None and self.mode == "micro":
            problems.append(
                "noise=NoiseScale(...) with sync='micro': every prefix of the window is then "
                "reduced across ranks, and its global item count is not known without one more "
                "all-reduce per micro-batch; use sync='window'"
            )
        if problems:
            raise ValueError(
                f"the Accumulator on a {self.kind.upper()} model cannot use:\n  - "
                + "\n  - ".join(problems)
            )

    # -- per micro-batch ----------------------------------------------------------------------

    def communicates(self, last: bool) -> bool:
        """Whether the backward of a micro-batch reduces gradients across ranks."""
        return self.reduces(last) and not self.reduce_at_end

    def reduces(self, last: bool) -> bool:
        """Whether a micro-batch's gradient is reduced across ranks by the time the next
        one runs (in its backward, or at the window's end for the last): its prefix of the
        window is then not this rank's alone."""
        return self.distributed and (last or self.mode == "micro")

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Forward and backward of one micro-batch; they communicate only when ``last`` (or
        in ``"micro"`` mode). DDP decides in forward, FSDP2 in backward: wrap both."""
        if not self.distributed:
            yield
            return
        communicate = self.communicates(last)
        self._forwards = 0
        if self.kind == "ddp":
            before = self.model.require_backward_grad_sync
            self.model.require_backward_grad_sync = communicate
        else:
            self.model.set_requires_gradient_sync(communicate)
        try:
            yield
        finally:
            self._forwards = None
            if self.kind == "ddp":
                self.model.require_backward_grad_sync = before
            else:
                self.model.set_requires_gradient_sync(True)

    def check_forward(self, index: int) -> None:
        """Refuse a backward whose forward ran outside this micro-batch's context."""
        if self.distributed and not self._forwards:
            raise RuntimeError(
                f"micro-batch {index}: no forward of the {self.kind.upper()} model ran inside "
                "`with acc.micro_batch(...)`; the loss was computed outside it. The forward "
                "decides whether the backward communicates gradients, so a forward outside the "
                "context would reduce on the wrong micro-batch and leave the ranks' gradients "
                "different: compute the loss inside the context"
            )

    def check_after_last(self, ended_last: bool) -> None:
        """Under ``sync="window"`` nothing may follow the micro-batch marked last."""
        if ended_last and self.mode == "window":
            raise RuntimeError(
                "micro_batch() after the one marked last=True: its gradient would miss the "
                "reduction; end the window with end_window() first"
            )

    def check_window_end(self, ended_last: bool) -> None:
        """Under ``sync="window"`` a window must end with a micro-batch marked last."""
        if self.distributed and not ended_last and self.mode == "window":
            raise RuntimeError(
                f"the window ended without a micro-batch marked last=True; under "
                f"{self.kind.upper()} the last micro-batch's backward is the one that "
                "reduces gradients: use `with acc.micro_batch(last=True)` for it"
            )

    def pad(self, given: list[Any]) -> tuple[list[Any], int]:
        """The micro-batches this rank runs in ``step()`` and how many of them are its own.

        Every rank runs as many micro-batches as the rank that holds the most: collective
        calls (DDP's reduction, FSDP2's all-gathers) must match, or ranks hang. A rank with
        fewer (or none) replays one sample it has held, with loss and count times zero,
        which adds exact zeros. That sample is copied from the window's last micro-batch, so
        the micro-batch itself is not kept past its window. One small all-reduce (MAX)."""
        if not self.distributed:
            return given, len(given)
        if given:
            self._pad = map_tensors(given[-1], lambda t: t[:1].clone())
        most, stuck = self._all_reduce(
            [len(given), int(self._pad is None)], torch.int64, dist.ReduceOp.MAX
        )
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
        return given + [self._pad] * (int(most) - len(given)), len(given)

    # -- the window's end ---------------------------------------------------------------------

    def totals(self, count: int, loss_sum: float) -> tuple[int, float]:
        """Items and loss summed over ranks: one all-reduce of two float64 scalars per window
        (exact for counts below 2**53)."""
        if not self.distributed:
            return count, loss_sum
        total, loss = self._all_reduce([float(count), loss_sum], torch.float64, dist.ReduceOp.SUM)
        return int(total), loss

    def reduce(self, sums: list[torch.Tensor]) -> None:
        """Under ``reduce_at_end``: the window's summed gradients averaged over ranks in place,
        as DDP's reduction would (sum / world), one all-reduce per dtype; and the module's
        buffers broadcast from rank 0, as DDP's next forward would (it broadcasts only after
        a backward that communicated, which no longer happens)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in sums:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.model.broadcast_buffers:
            with torch.no_grad():
                for b in self.inner.buffers():
                    dist.broadcast(b, src=dist.get_global_rank(self.group, 0), group=self.group)

    def most(self, values: list[int]) -> list[int]:
        """Each value's largest over the ranks (one small all-reduce): e.g. the planner's
        measured peaks, so every rank decides on the fullest rank's numbers."""
        return [int(v) for v in self._all_reduce(values, torch.int64, dist.ReduceOp.MAX)]

    def agree_oom(self, failed: bool, largest: int) -> tuple[bool, int]:
        """After a window's micro-batches: whether any rank ran out of memory, and the
        largest micro-batch any rank ran (one small all-reduce), so every rank replays
        together, at one size."""
        failed_anywhere, most = self._all_reduce(
            [int(failed), largest], torch.int64, dist.ReduceOp.MAX
        )
        return bool(failed_anywhere), int(most)

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
        rank takes the same skip and clipping decision. A pipeline's stages are summed so too."""
        norm = total_norm(local_grads)
        if self.kind not in ("fsdp", "pipeline"):
            return norm
        squared = norm.double().square().to(self._device)
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()

    def _all_reduce(self, values: list[float], dtype: torch.dtype, op: Any) -> list[float]:
        t = torch.tensor(values, dtype=dtype, device=self._device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()


def kind_of(model: torch.nn.Module) -> str:
    """ "ddp" (DistributedDataParallel), "fsdp" (FSDP2's fully_shard) or "local"."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "fsdp" if isinstance(model, FSDPModule) else "local"


def collective_device(group: Any = None) -> torch.device:
    """Where a group's collectives take their tensors: the current GPU for nccl, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
