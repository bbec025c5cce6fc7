"""Seconds per optimizer step of a 2-stage pipeline against its number of micro-batches.

Two processes on gloo (127.0.0.1, one thread each, so the stages really run side by side on
this machine's 2 cores), each holding one half of a small causal LM (embeddings and 2 blocks;
2 blocks and the head), train exact windows (``gradaccum.pipeline.PipelineWindow``) of 32
sequences of 64 tokens as m = 1, 2, 4, 8, 16 micro-batches, GPipe and 1F1B. For each m:

- seconds per step (median of 10 steps after 2 warm-up steps, learning rate 0 so every step
  is the same work);
- each stage's busy time: m x its own forward and backward of one micro-batch, timed alone
  in the same process before the pipeline runs (median of 9);
- the measured bubble, 1 - busy / step for the busier stage, next to (p - 1) / (m + p - 1),
  the idle share of an ideal schedule with equal stages and free communication.

Writes bench/results/pipeline.md and pipeline.png. Takes about a minute on 2 cores.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import gradaccum as ga
from gradaccum.pipeline import PipelineWindow

OUT = Path(__file__).parent / "results"
V, T, D, BLOCKS, BATCH, STAGES = 64, 64, 256, 2, 32, 2
MS, STEPS, WARMUP, ALONE = (1, 2, 4, 8, 16), 10, 2, 9


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.ln(x))


def stage_module(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    blocks = [Block() for _ in range(BLOCKS)]
    if rank == 0:
        return nn.Sequential(nn.Embedding(V, D), *blocks)
    return nn.Sequential(*blocks, nn.LayerNorm(D), nn.Linear(D, V))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (BATCH, T), generator=torch.Generator().manual_seed(0))
    return ids, ids.roll(-1, 1)


def alone(model: nn.Module, rank: int, micro: int) -> float:
    """One micro-batch's forward and backward on this stage, no pipeline, median seconds."""
    ids, labels = batch()
    times = []
    for _ in range(ALONE):
        if rank == 0:
            x = ids[:micro]
        else:
            x = torch.randn(micro, T, D, requires_grad=True)
        t0 = time.perf_counter()
        out = model(x)
        if rank == 0:
            out.sum().backward()
        else:
            ga.token_cross_entropy(out, labels[:micro])[0].backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=STAGES,
        timeout=datetime.timedelta(seconds=120),
    )
    model = stage_module(rank)
    ids, labels = batch()
    rows = []
    for m in MS:
        busy = m * alone(model, rank, BATCH // m)
        row = {"m": m, "busy": busy}
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < STAGES:
                row[schedule] = None  # 1F1B needs at least one micro-batch per stage
                continue
            stage = PipelineStage(model, rank, STAGES, torch.device("cpu"))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            window = PipelineWindow(stage, optimizer, ga.token_cross_entropy, m, schedule=schedule)
            times = []
            for i in range(WARMUP + STEPS):
                dist.barrier()
                t0 = time.perf_counter()
                window.step(ids, target=labels)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
            row[schedule] = statistics.median(times)
        rows.append(row)
    Path(out, f"stage{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can abort after the results are written


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(port, tmp), nprocs=STAGES, start_method="spawn")
        stages = [json.loads(Path(tmp, f"stage{r}.json").read_text()) for r in range(STAGES)]
    rows = []
    for per_stage in zip(*stages, strict=True):
        m = per_stage[0]["m"]
        busy = max(x["busy"] for x in per_stage)
        step = {
            s: None if per_stage[0][s] is None else max(x[s] for x in per_stage)
            for s in ("gpipe", "1f1b")
        }
        rows.append(
            {
                "m": m,
                "busy": busy,
                "busy_per_stage": [x["busy"] for x in per_stage],
                **step,
                "bubble_gpipe": 1 - busy / step["gpipe"],
                "bubble_1f1b": None if step["1f1b"] is None else 1 - busy / step["1f1b"],
                "ideal": (STAGES - 1) / (m + STAGES - 1),
            }
        )
    machine = f"{platform.machine()}, torch {torch.__version__}, 2 processes x 1 thread"
    (OUT / "pipeline.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    (OUT / "pipeline.md").write_text(report(rows, machine))
    plot(rows)
    print(report(rows, machine))


def report(rows: list[dict], machine: str) -> str:
    def f(v: float | None, digits: int) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [
        f"| {r['m']} | {BATCH // r['m']} | {f(r['gpipe'], 3)} | {f(r['1f1b'], 3)} | "
        f"{r['busy']:.3f} | {f(r['bubble_gpipe'], 2)} | {f(r['bubble_1f1b'], 2)} | "
        f"{r['ideal']:.2f} |"
        for r in rows
    ]
    return "\n".join(
        [
            "# A 2-stage pipeline against its number of micro-batches",
            "",
            f"`python bench/pipeline.py` ({machine}): a causal LM of 2 x {BLOCKS} blocks "
            f"(d {D}, vocabulary {V}) split into 2 stages on gloo, exact windows "
            f"(`PipelineWindow`) of {BATCH} sequences of {T} tokens in m micro-batches; "
            f"median of {STEPS} steps. Busy: m x the busier stage's forward and backward of "
            "one micro-batch timed alone; measured bubble: 1 - busy / step; ideal: "
            "(p - 1) / (m + p - 1) for p = 2. (1F1B needs m >= p.)",
            "",
            "| m | micro-batch | s/step GPipe | s/step 1F1B | busy (s) | bubble GPipe | "
            "bubble 1F1B | ideal bubble |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
            "",
        ]
    )


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r["m"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ms, [r["gpipe"] for r in rows], marker="o", label="GPipe")
    ones = [r for r in rows if r["1f1b"] is not None]
    left.plot([r["m"] for r in ones], [r["1f1b"] for r in ones], marker="s", label="1F1B")
    left.plot(ms, [r["busy"] for r in rows], linestyle="--", label="busy (stage alone)")
    left.set_xscale("log", base=2)
    left.set_xlabel("micro-batches per window (m)")
    left.set_ylabel("seconds per optimizer step")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(ms, [r["bubble_gpipe"] for r in rows], marker="o", label="measured, GPipe")
    right.plot(
        [r["m"] for r in ones], [r["bubble_1f1b"] for r in ones], marker="s", label="measured, 1F1B"
    )
    right.plot(ms, [r["ideal"] for r in rows], linestyle="--", label="(p-1)/(m+p-1)")
    right.set_xscale("log", base=2)
    right.set_xlabel("micro-batches per window (m)")
    right.set_ylabel("idle share of a step")
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle("2-stage pipeline: time per step and bubble against m")
    fig.tight_layout()
    fig.savefig(OUT / "pipeline.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
