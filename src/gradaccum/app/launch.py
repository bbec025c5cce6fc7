"""The processes of a torchrun job, for `gradaccum train`: join the group, agree, leave.

Gradient communication itself is ``gradaccum.sync``; these are the few collective decisions
the command line makes around training (rank 0 picks the run folder and the plan, a signal
on one rank stops all of them).
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from gradaccum.sync import collective_device

__all__ = ["any_rank", "broadcast", "init_from_env", "is_main", "main_int", "shutdown"]


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
    return _alone() or dist.get_rank() == 0


def shutdown() -> None:
    """Leave the process group. FSDP2's modules and device mesh hold it through reference
    cycles: they are collected first, so nothing of theirs outlives the group."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _alone() -> bool:
    """Outside a process group: each agreement below is this process's own value."""
    return not (dist.is_available() and dist.is_initialized())


def broadcast(value, src: int = 0):
    """Rank ``src``'s value on every rank (a small picklable object between the job's own
    processes: a path, a verdict, a plan)."""
    if _alone():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first_message(message: str | None) -> str | None:
    """The lowest rank's message among the ranks that have one, on every rank (None: none
    has): what went wrong, said by whichever process saw it."""
    if _alone():
        return message
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return next((m for m in gathered if m is not None), None)


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (e.g. a signal that reached one rank)."""
    if _alone():
        return bool(flag)
    t = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main_int(value: int) -> int:
    """Rank 0's integer on every rank, in one small tensor broadcast (a decision each rank
    would otherwise make from its own numbers, e.g. auto's next effective batch)."""
    if _alone():
        return int(value)
    t = torch.tensor([int(value)], device=collective_device())
    dist.broadcast(t, src=0)
    return int(t.item())
