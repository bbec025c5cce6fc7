"""What each of the 2 processes of test_wrappers.py runs: an Accumulator handed a model inside
another framework's wrapper (Lightning Fabric's, torch.compile's, what Accelerate's prepare
returns) around DDP. Each rank writes
what it saw (the gradient the optimizer was handed, the window's count and loss, how many
gradient all-reduces DDP ran) for the test to check against a full batch computed with torch
alone, in the test's own process."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from helpers import MLP, make_model, mlp_loss, regression_batch, split_sizes
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import gradaccum as ga
from gradaccum.sync import LocalModelWarning, one_process

GLOBAL_BATCH = 13
LR = 0.5
# Per window, the micro-batch sizes of rank 0 and of rank 1: rank 0 holds the first
# sum(rank 0's sizes) samples of the window's global batch of 13, rank 1 the rest, so the
# ranks hold different numbers of items (6 and 7, then 5 and 8) in as many micro-batches.
WINDOWS = [([2, 4], [3, 4]), ([1, 2, 2], [3, 3, 2])]


def window_batch(window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(seed=100 + window, n=GLOBAL_BATCH)


def my_micro_batches(window: int, rank: int) -> list:
    sizes = WINDOWS[window]
    x, y = window_batch(window)
    start = 0 if rank == 0 else sum(sizes[0])
    stop = start + sum(sizes[rank])
    return split_sizes((x[start:stop], y[start:stop]), sizes[rank])


def counted(ddp: DistributedDataParallel) -> list[int]:
    """How many gradient all-reduces ``ddp`` runs (a comm hook is called once per bucket per
    reduction; the MLP's gradients fit one bucket)."""
    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return calls


def train(model: torch.nn.Module, optimizer, sgd: torch.optim.SGD, rank: int) -> dict:
    """Every window of WINDOWS through ``ga.Accumulator(model, optimizer)``; ``sgd`` is the
    torch optimizer inside the framework's ``optimizer``, whose steps are recorded."""
    handed: list[dict[str, torch.Tensor]] = []
    sgd.register_step_pre_hook(
        lambda *_: handed.append({n: p.grad.clone() for n, p in net_params(model)})
    )
    acc = ga.Accumulator(model, optimizer)
    results = [acc.step(my_micro_batches(w, rank), mlp_loss) for w in range(len(WINDOWS))]
    return {
        "sync": repr(acc.sync),
        "grads": handed,
        "counts": [r.count for r in results],
        "losses": [r.loss for r in results],
        "params": {n: p.detach().clone() for n, p in net_params(model)},
    }


def net_params(model: torch.nn.Module):
    """The MLP's parameters by their own names, whatever wraps it."""
    for name, p in model.named_parameters():
        for prefix in ("_forward_module.", "_orig_mod.", "module."):
            name = name.replace(prefix, "")
        yield name, p


def fabric_ddp(rank: int, world: int) -> dict:
    """Lightning Fabric's DDP inside the processes the launcher started: Fabric reads them
    from the environment (LOCAL_RANK set: the processes are created externally) and takes
    the process group already initialised."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    net = make_model(MLP)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    model, optimizer = fabric.setup(net, sgd)
    assert isinstance(model._forward_module, DistributedDataParallel), type(model)
    calls = counted(model._forward_module)
    out = train(model, optimizer, sgd, rank)
    return {**out, "reductions": calls[0], "wrapper": type(model).__name__}


def compiled_ddp(rank: int, world: int) -> dict:
    """torch.compile's OptimizedModule around DDP (the eager backend: dynamo's wrapper and
    its tracing, without a C++ compiler)."""
    ddp = DistributedDataParallel(make_model(MLP))
    calls = counted(ddp)
    model = torch.compile(ddp, backend="eager")
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    out = train(model, sgd, sgd, rank)
    return {**out, "reductions": calls[0], "wrapper": type(model).__name__}


def accelerate_ddp(rank: int, world: int) -> dict:
    """What accelerate.prepare returns for several CPU processes with a dynamo backend:
    torch.compile's OptimizedModule around torch's own DDP (accelerate has no wrapper class
    of its own around DDP). It reads the processes from the environment and takes the group
    already initialised."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    net = make_model(MLP)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(net, sgd)
    assert isinstance(model._orig_mod, DistributedDataParallel), type(model)
    calls = counted(model._orig_mod)
    out = train(model, optimizer, sgd, rank)
    return {**out, "reductions": calls[0], "wrapper": type(model).__name__}


def unknown_wrapper(rank: int, world: int) -> str:
    """A module of a class gradaccum does not know, holding a DDP model: refused."""

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = DistributedDataParallel(make_model(MLP))

        def forward(self, x):
            return self.inner(x)

    model = Holder()
    try:
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    except ValueError as e:
        return str(e)
    return "accepted"


def plain_model(rank: int, world: int) -> dict[str, list[str]]:
    """A model that is not distributed, under a process group of 2: the warnings it gives,
    built twice at one place, then once more at another; and none where one process's model
    is meant (``one_process()``, ``ga.check``)."""

    def built() -> None:
        model = make_model(MLP)
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))

    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: once per place it is issued from
        for _ in range(2):
            model = make_model(MLP)
            ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
        model = make_model(MLP)
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR))
    out["plain"] = [f"{Path(w.filename).name}: {w.category.__name__}: {w.message}" for w in seen]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with one_process():
            built()
        ga.check(make_model(MLP), window_batch(0), mlp_loss, 4)
    out["meant"] = [str(w.message) for w in seen if issubclass(w.category, LocalModelWarning)]
    return out


def run(rank: int, world: int, out: str) -> None:
    """Every case, one launch; each rank writes what it saw."""
    results = {
        "fabric": fabric_ddp(rank, world),
        "compiled": compiled_ddp(rank, world),
        "accelerate": accelerate_ddp(rank, world),
        "unknown": unknown_wrapper(rank, world),
        **plain_model(rank, world),
    }
    torch.save(results, Path(out) / f"rank{rank}.pt")
