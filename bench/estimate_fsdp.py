"""The FSDP2 estimate (``ga.estimate(shard="fsdp")``) against real FSDP2 windows on this
machine: 2 processes on gloo over 127.0.0.1, a GPT-shaped model of tens of MB
(tests/integration/distributed/estimate_worker.py: 6 blocks and the root wrapped by
``fully_shard``), two windows through gradaccum's Accumulator, each rank's live tensor bytes
measured by tests/support/live_tensors.py's ``LiveBytes`` (no code of the estimate). Each case
is run several times, each run a fresh pair of processes.

Writes (or rewrites) its own section of bench/results/estimate.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests/integration/distributed")]

import estimate_worker as worker  # noqa: E402
from launch import launch  # noqa: E402
from machine import describe  # noqa: E402

import gradaccum as ga  # noqa: E402

OUT = HERE / "results" / "estimate.md"
TITLE = "## FSDP2 over 2 processes: the estimate against real FSDP2 windows on this CPU"
RUNS = 5
CASES = [("window", 4, 2), ("micro", 4, 2), ("window", 8, 3), ("micro", 8, 3)]
MB = 1e6


def main() -> None:
    rows = []
    for sync, micro_size, micro_batches in CASES:
        peaks: dict[int, list[int]] = {0: [], 1: []}
        for _ in range(RUNS):
            with tempfile.TemporaryDirectory(prefix="gradaccum-fsdp-") as tmp:
                launch(worker.fsdp_peak, sync, micro_size, micro_batches, tmp, timeout=300)
                for r in (0, 1):
                    peaks[r].append(json.loads(Path(tmp, f"rank{r}.json").read_text())["peak"])
        started = time.perf_counter()
        est = ga.estimate(worker.Net, worker.adamw, worker.sample, worker.loss_fn,
                          micro_size=micro_size, micro_batches=micro_batches, device="cpu",
                          world_size=2, shard="fsdp", sync=sync)  # fmt: skip
        seconds = time.perf_counter() - started
        row = (sync, micro_size, micro_batches, est.allocated, peaks, seconds)
        print(row, flush=True)
        rows.append(row)
    write(rows)


def write(rows) -> None:
    params = sum(p.numel() for p in worker.Net().parameters())
    lines = [
        TITLE,
        "",
        "`python bench/estimate_fsdp.py`. " + describe(threads=1) + f" Load average at the "
        f"end {os.getloadavg()[0]:.1f}. A GPT-shaped model ({params / 1e6:.2f}M parameters: "
        f"vocabulary {worker.VOCAB}, width {worker.WIDTH}, {worker.LAYERS} blocks, "
        f"{worker.LENGTH} tokens), each block and the root wrapped by `fully_shard` (defaults), "
        "AdamW, fp32, two windows through gradaccum's Accumulator with its gradient sync "
        f"mode, 2 gloo processes; {RUNS} runs of each case, each rank measured (so "
        f"{2 * RUNS} measurements a case) by `LiveBytes` (tests/support/live_tensors.py: "
        "storages by identity, their sizes summed after every op, so FSDP2's in-place "
        'resizes count). Predicted: `ga.estimate(..., device="cpu", world_size=2, '
        'shard="fsdp", sync=...)`, rank 0 (the larger shards). MB = 1e6 bytes.',
        "",
        "| sync | micro-batch x per window | predicted | measured max | error vs max | "
        "rank 0: min-max | rank 1: min-max | runs above rank 0's min | estimate time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sync, size, n, predicted, peaks, seconds in rows:
        high = max(peaks[0] + peaks[1])
        above = sum(p > min(peaks[0]) for p in peaks[0])
        lines.append(
            f"| {sync} | {size} x {n} | {predicted / MB:.3f} | {high / MB:.3f} | "
            f"{(predicted - high) / high:+.2%} | "
            + " | ".join(f"{min(peaks[r]) / MB:.3f}-{max(peaks[r]) / MB:.3f}" for r in (0, 1))
            + f" | {above} of {RUNS} | {seconds:.1f} s |"
        )
    lines += [
        "",
        "Rank 1's shards are smaller (the vocabulary's rows split unevenly, 2050 and 2049). "
        "The meter sees the ops of each rank's own thread, not gloo's; a buffer that gloo's "
        "thread lets go of after FSDP2 has is counted until then, which can move a run's peak "
        "where the peak is in backward (the micro-batch-4 micro case).",
        "",
    ]
    text = OUT.read_text()
    start = text.find(TITLE)
    if start >= 0:  # this section again: replaced up to the next section
        end = text.find("\n## ", start + len(TITLE))
        text = text[:start] + text[end + 1 :] if end >= 0 else text[:start]
    OUT.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
