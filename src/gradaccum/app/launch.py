"""The processes of a torchrun job, for `gradaccum train`: join the group, agree, leave.

Gradient communication itself is ``gradaccum.sync``; these are the few collective decisions
the command line makes around training (rank 0 picks the run folder and the plan, a signal
on one rank stops all of them).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shlex
import sys
from pathlib import Path

import torch
import torch.autograd.graph as _autograd_graph
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from gradaccum.sync import collective_device

__all__ = [
    "any_rank",
    "broadcast",
    "first_message",
    "init_from_env",
    "is_main",
    "main_int",
    "peer_gone",
    "resume_command",
    "shutdown",
]


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


def together_then_leave() -> None:
    """Every rank waits here for the others (rank 0 having said the job's line first), so
    that no rank exits before rank 0 has spoken: torchrun stops the whole job as soon as one
    rank exits with a failure, which cut off rank 0's 'continue with' line after a stop
    signal that reached one rank alone. A peer already gone ends the wait."""
    if _alone():
        return
    with contextlib.suppress(Exception):  # a peer gone: nothing to wait for
        any_rank(False)


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


def resume_command(folder: str | Path, processes: int | None = None) -> str:
    """The command that resumes the run in ``folder`` as this job was launched: under
    torchrun (WORLD_SIZE and LOCAL_WORLD_SIZE in the environment), torchrun with its
    process count and the program it ran (``-m gradaccum``, or the script's path);
    otherwise ``gradaccum train --resume DIR``. With ``processes``: the launch of that many
    processes on one machine instead. Every "continue with" line is this one."""
    resume = f"train --resume {shlex.quote(str(folder))}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    want = world if processes is None else processes
    if want <= 1:
        return f"gradaccum {resume}"
    program = "-m gradaccum"
    argv = getattr(sys, "orig_argv", sys.argv)
    if world > 1 and "-m" not in argv[:-1]:  # torchrun SCRIPT, torchrun --no-python gradaccum
        program = shlex.quote(sys.argv[0])
    elif world > 1:  # torchrun -m gradaccum: the worker is python -u -m gradaccum
        program = f"-m {argv[argv.index('-m') + 1]}"
    if processes is None and world > local:
        return f"torchrun --nnodes {world // local} --nproc-per-node {local} {program} {resume}"
    return f"torchrun --nproc-per-node {want} {program} {resume}"


def peer_gone(err: BaseException) -> str | None:
    """What to say when ``err`` (or an exception it was raised while handling: torchrun's
    SIGTERM lands while the first unwinds) is a collective that failed because another
    process of the job is gone: torch.distributed's DistBackendError (nccl), or the
    RuntimeError that gloo raises from inside a collective (its connection to the peer
    reset or closed): raised in torch.distributed's collectives, or in the autograd engine,
    where DDP's and FSDP2's gradient hooks run theirs. None for anything else. The peer's
    rank is known in a job of two."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistBackendError) or (
            isinstance(err, RuntimeError) and _raised_in_a_collective(err)
        ):
            rank = int(os.environ.get("RANK", "0"))
            world = int(os.environ.get("WORLD_SIZE", "1"))
            peer = f" (rank {1 - rank})" if world == 2 else ""
            return (
                f"another process of this job{peer} died while rank {rank} waited on it in "
                f"a collective ({type(err).__name__}), so rank {rank} stops too; the "
                "launcher's report says how that process ended"
            )
        err = err.__cause__ or err.__context__
    return None


# Where a collective's failure surfaces in Python: c10d's ``work.wait()``, and the autograd
# engine (the backward's gradient all-reduce or reduce-scatter runs in its hooks).
_COLLECTIVES = {Path(_c10d.__file__), Path(_autograd_graph.__file__)}


def _raised_in_a_collective(err: BaseException) -> bool:
    """The innermost frame of ``err``'s traceback is one where a collective waits."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename) in _COLLECTIVES
