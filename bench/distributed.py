"""Seconds per optimizer step under DDP and FSDP2, and FSDP2's per-rank peak memory: sync
once per window vs every micro-batch.

2 processes on gloo over 127.0.0.1 (a free port), 1 thread each, the `gpt` recipe's GPT with
4 layers and d_model 256 (3.2M parameters, a 13 MB gradient), micro-batches of 4 x 64 bytes,
SGD. For N in {1, 4, 16} micro-batches per window: ``sync="window"`` (one reduction per
step, in the last backward) and ``sync="micro"`` (one per micro-batch) on two copies of the
model, taking turns window by window; 2 warm-up windows, then the median of REPEATS. The
two modes give the same step; only time and memory differ.

Memory, in a second launch: for each N and mode a fresh FSDP2 model, one warm-up window,
then each rank's peak over 2 windows as `gradaccum train` measures it (the shards'
parameters and buffers, plus the resident set's rise), with glibc's mmap threshold fixed
(MALLOC_MMAP_THRESHOLD_=65536) so that freed tensors leave the resident set; with glibc's
moving threshold, runs peak megabytes apart by chance.

Writes bench/results/distributed.md and bench/results/distributed.png.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import describe

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.app.recipes.stdlib_text import corpus_bytes, full_length_batch

OUT = Path(__file__).parent / "results"
NS, MICRO, SEQ, WARMUP, REPEATS = [1, 4, 16], 4, 64, 2, 11
GRADIENT_PARAMS = sum(
    p.numel() for p in GPT(GPTConfig(max_len=SEQ, d_model=256, n_heads=4, n_layers=4)).parameters()
)
KINDS, MODES = ["ddp", "fsdp"], ["window", "micro"]


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_len=SEQ, d_model=256, n_heads=4, n_layers=4))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def loss_fn(m, mb):
    return ga.causal_lm_loss(m(mb["input_ids"]), mb["labels"])


def join(rank: int, port: int) -> None:
    """This process into the 2-process gloo group on 127.0.0.1, 1 thread."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )


def worker(rank: int, port: int, out: str) -> None:
    join(rank, port)
    data = corpus_bytes()
    results = {}
    for kind in KINDS:
        # Both modes side by side, taking turns window by window: drift of the shared machine
        # hits both alike.
        accs = {}
        for mode in MODES:
            model = build(kind)
            accs[mode] = ga.Accumulator(
                model, torch.optim.SGD(model.parameters(), lr=0.01), sync=mode
            )
        for n in NS:
            times = {mode: [] for mode in MODES}
            for w in range(WARMUP + REPEATS):
                batch = full_length_batch(data, MICRO * n, SEQ, seed=1000 * rank + w)
                for mode in MODES if w % 2 == 0 else MODES[::-1]:
                    dist.barrier()  # both ranks start the window together
                    start = time.perf_counter()
                    accs[mode].step(ga.split(batch, MICRO), loss_fn)
                    if w >= WARMUP:
                        times[mode].append(time.perf_counter() - start)
            for mode in MODES:
                results[(kind, mode, n)] = statistics.median(times[mode])
            if rank == 0:
                print(f"{kind} N={n} done", file=sys.stderr, flush=True)
    if rank == 0:
        torch.save(results, Path(out) / "times.pt")
    dist.destroy_process_group()


def memory_worker(rank: int, port: int, out: str) -> None:
    """Each rank's training peak under FSDP2 for each mode and N (a fresh model each)."""
    from gradaccum.memory import TrainingMemory

    join(rank, port)
    data = corpus_bytes()
    peaks = {}
    for mode in MODES:
        for n in NS:
            model = build("fsdp")
            acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), sync=mode)
            for w in range(3):
                if w == 1:  # after the warm-up window: as a training run's meter starts
                    memory = TrainingMemory(model, "cpu")
                batch = full_length_batch(data, MICRO * n, SEQ, seed=1000 * rank + w)
                acc.step(ga.split(batch, MICRO), loss_fn)
            both = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            dist.all_gather(both, torch.tensor([memory.peak()]))
            peaks[(mode, n)] = [int(p) for p in both]
            del acc, model
    if rank == 0:
        torch.save(peaks, Path(out) / "memory.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(free_port(), out), nprocs=2)
        times = torch.load(Path(out) / "times.pt", weights_only=False)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the processes spawned next
        mp.spawn(memory_worker, args=(free_port(), out), nprocs=2)
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        peaks = torch.load(Path(out) / "memory.pt", weights_only=False)
    lines = [
        "# Distributed: seconds per optimizer step, sync per window vs per micro-batch",
        "",
        f"2 processes, gloo over 127.0.0.1, 1 thread each; GPT 4 layers, d_model 256 (3.2M "
        f"parameters), micro-batches of {MICRO} x {SEQ} bytes, SGD. {describe(threads=1)} "
        f"Median of {REPEATS} windows after {WARMUP} warm-up, the "
        "two modes taking turns.",
        "",
        "| model | N | sync per window | sync per micro-batch | per micro-batch / per window |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        for n in NS:
            w, m = times[(kind, "window", n)], times[(kind, "micro", n)]
            name = "DDP" if kind == "ddp" else "FSDP2"
            lines.append(f"| {name} | {n} | {w:.3f} s | {m:.3f} s | {m / w:.2f}x |")
    mib = 2**20
    lines += [
        "",
        "## FSDP2: peak memory per rank",
        "",
        "Each rank's peak over 2 windows after a warm-up, as `gradaccum train` measures it "
        "(the shards' parameters and buffers plus the resident set's rise), with glibc's mmap "
        "threshold fixed so freed tensors leave the resident set; the model's whole gradient "
        f"is {4 * GRADIENT_PARAMS / mib:.1f} MiB, a shard of it half that.",
        "",
        "| N | sync per window (rank 0, rank 1) | sync per micro-batch (rank 0, rank 1) "
        "| window - micro |",
        "|---:|---:|---:|---:|",
    ]
    for n in NS:
        w, m = peaks[("window", n)], peaks[("micro", n)]
        lines.append(
            f"| {n} | {w[0] / mib:.1f} MiB, {w[1] / mib:.1f} MiB | {m[0] / mib:.1f} MiB, "
            f"{m[1] / mib:.1f} MiB | {(max(w) - max(m)) / mib:+.1f} MiB |"
        )
    lines += [
        "",
        "At N=1 the two modes are the same program (one micro-batch, one reduction). With N "
        "micro-batches, per-window sync does one reduction per step and per-micro-batch sync "
        "does N. Under FSDP2, per-micro-batch sync keeps only a shard of the gradient between "
        "micro-batches (less memory); gloo's reduce-scatter is one all-reduce per rank, so on "
        "CPU it costs more than on NCCL.",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "distributed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=False)
    for ax, kind in zip(axes, KINDS, strict=True):
        for mode in MODES:
            label = "sync per window" if mode == "window" else "sync per micro-batch"
            ax.plot(NS, [times[(kind, mode, n)] for n in NS], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.set_xlabel("micro-batches per window (N)")
        ax.set_ylabel("seconds per optimizer step")
        ax.set_title("DDP" if kind == "ddp" else "FSDP2")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "distributed.png", dpi=110)
    print(f"wrote {OUT / 'distributed.md'} and {OUT / 'distributed.png'}")


if __name__ == "__main__":
    main()
