"""Run a function in 2 real processes on gloo, rendezvous on 127.0.0.1 at a free port.

A run that does not finish in time is killed and fails the test: a hang is a failure, not a
stuck CI job.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(processes: int = 2) -> list[str]:
    """The command that starts torchrun with ``processes`` processes on 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=45),
    )
    try:
        fn(rank, world, *args)
        # The model, its hooks and its device mesh (reference cycles) freed while the group
        # still lives; then both ranks past their last collective before either tears the
        # group down: a rank destroying it while the other's gloo work was in flight aborted
        # ("terminate called without an active exception") about one launch in ten.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo threads still holding work objects at
    # finalization can abort the process (SIGABRT, "terminate called without an active
    # exception") after every result was written; CI saw it once on an FSDP launch with the
    # barrier above in place (pytorch/pytorch#179291 describes the teardown race). The test
    # judges what fn wrote; fn's own failures still raise above and reach the parent through
    # the spawn error file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, *args, world: int = 2, timeout: float = 60.0) -> None:
    """``fn(rank, world, *args)`` in ``world`` processes; raises if one fails or time runs out."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children at spawn
    try:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, free_port(), args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = before
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"{world} processes did not finish within {timeout:.0f} s (hang)")
