"""Seconds per optimizer step: a hand-written loop, gradaccum, Accelerate, Lightning Fabric.

A small byte-level transformer LM (the `gpt` recipe's GPT with 2 layers, d_model 128,
128-byte sequences), the same micro-batches for all, AdamW, 2 threads pinned. Each window is
N micro-batches of 8 sequences. The implementations take turns window by window (rotating
who goes first) after 3 warm-up windows each; ratios are to the hand loop, the lower bound
(no validation, no normalization by count, no norm, no guard).

Why one model and several processes: where a model's tensors land in memory changes its step
time by about 2% for the life of a process (two identical hand loops, each with its own copy of
the model, differed by that much, consistently). So all implementations wrap one shared model
and optimizer, and each of PROCESSES fresh processes measures every window's time over the
hand loop's in the same round (the paired ratio; machine drift cancels); the table reports the
median over processes with their range. A second, identical hand loop is measured as a
control: its ratio is the noise floor.

Writes bench/results/overhead.md and bench/results/overhead.png.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import describe
from peers import IMPLEMENTATIONS, HandLoop

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.app.recipes.stdlib_text import corpus_bytes, full_length_batch

OUT = Path(__file__).parent / "results"
MICRO, NS, WARMUP, REPEATS, PROCESSES = 8, [1, 4, 8], 3, 31, 5


class HandLoopControl(HandLoop):
    """The same hand loop again: how far apart two identical loops measure."""

    name = "hand loop (control)"


RUNNERS = [*IMPLEMENTATIONS, HandLoopControl]


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(max_len=128, d_model=128, n_heads=4, n_layers=2))


def mean_loss(m, mb):
    logits = m(mb["input_ids"])[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb["labels"][:, 1:].reshape(-1)
    )


def sum_loss(m, mb):
    return ga.causal_lm_loss(m(mb["input_ids"]), mb["labels"])


def measure(n: int, data: bytes) -> dict[str, list[float]]:
    """Seconds of every measured window, by implementation, in one process."""
    # One model and one optimizer for all: each implementation wraps the same tensors, so
    # where they lie in memory cannot favour one of them (with a model each, two identical
    # hand loops differed by ~2% for a whole process). Values do not change the compute.
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    runners = [impl(net, optimizer, n) for impl in RUNNERS]
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for w in range(WARMUP + REPEATS):
        micro = ga.split(full_length_batch(data, MICRO * n, 128, seed=w), MICRO)
        order = runners[w % len(runners) :] + runners[: w % len(runners)]
        for r in order:
            start = time.perf_counter()
            r.window(micro, mean_loss, sum_loss)
            if w >= WARMUP:
                times[r.name].append(time.perf_counter() - start)
    return times


def worker() -> None:
    torch.set_num_threads(2)
    data = corpus_bytes()
    print(json.dumps({n: measure(n, data) for n in NS}))


def paired(times: dict[str, list[float]]) -> dict[str, float]:
    hand = times["hand loop"]
    return {
        name: statistics.median(a / b for a, b in zip(t, hand, strict=True))
        for name, t in times.items()
    }


def pooled_ratio(runs: list[dict], n: int, a: str, b: str) -> tuple[float, float, float]:
    """Median over all rounds of all processes of a's window time over b's in the same round,
    with a 95% bootstrap interval of that median (2,000 resamples, seeded)."""
    ratios = [x / y for run in runs for x, y in zip(run[n][a], run[n][b], strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), medians[50], medians[1949]


def main() -> None:
    runs = []
    for p in range(PROCESSES):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--worker"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        runs.append({int(n): t for n, t in json.loads(out.strip().splitlines()[-1]).items()})
        print(
            f"process {p + 1}/{PROCESSES} done in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    names = [impl.name for impl in RUNNERS]
    ratios = {n: [paired(run[n]) for run in runs] for n in NS}  # per process
    median_ratio = {n: {k: statistics.median(r[k] for r in ratios[n]) for k in names} for n in NS}
    seconds = {
        n: {k: statistics.median(t for run in runs for t in run[n][k]) for k in names} for n in NS
    }
    lines = [
        "# Overhead: seconds per optimizer step",
        "",
        f"GPT 2 layers, d_model 128, micro-batches of {MICRO} x 128 bytes, AdamW. "
        f"{describe(threads=2, peers=True)} {PROCESSES} fresh processes x {REPEATS} windows after "
        f"{WARMUP} warm-up, the implementations taking turns.",
        "",
        "Ratio to the hand loop: median over processes of each process's median paired ratio "
        "(each window's time over the hand loop's in the same round), with the range over "
        "processes. The control is a second, identical hand loop: its distance from 1.000 is "
        "the noise floor.",
        "",
        "| N | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in NS:
        cells = []
        for k in names:
            per = [r[k] for r in ratios[n]]
            cells.append(f"{median_ratio[n][k]:.3f}x ({min(per):.3f}-{max(per):.3f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "gradaccum against each directly: the median over all rounds of all processes "
        f"({PROCESSES * REPEATS} per N) of gradaccum's window time over the other's in the "
        "same round, with a 95% bootstrap interval; an interval that holds 1.000 means no "
        "difference this machine can resolve.",
        "",
        "| N | gradaccum / hand loop | gradaccum / Accelerate | gradaccum / Fabric | "
        "control / hand loop |",
        "|---:|---:|---:|---:|---:|",
    ]
    pairs = [
        ("gradaccum", "hand loop"),
        ("gradaccum", "Accelerate"),
        ("gradaccum", "Lightning Fabric"),
        ("hand loop (control)", "hand loop"),
    ]
    for n in NS:
        cells = []
        for a, b in pairs:
            mid, low, high = pooled_ratio(runs, n, a, b)
            cells.append(f"{mid:.3f}x [{low:.3f}, {high:.3f}]")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Median seconds per optimizer step over all measured windows:",
        "",
        "| N | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in NS:
        lines.append(f"| {n} | " + " | ".join(f"{seconds[n][k]:.4f} s" for k in names) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "overhead.md").write_text("\n".join(lines) + "\n")
    (OUT / "overhead.json").write_text(json.dumps({"per_process_seconds": runs}))
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.16
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(NS))]
        ax.bar(xs, [median_ratio[n][name] for n in NS], width, label=name)
        for x, n in zip(xs, NS, strict=True):
            per = [r[name] for r in ratios[n]]
            ax.plot([x, x], [min(per), max(per)], color="black", linewidth=1)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_ylim(0.9, 1.1)
    ax.set_xticks([j + 2 * width for j in range(len(NS))], [f"N={n}" for n in NS])
    ax.set_ylabel("seconds per step / hand loop")
    ax.set_title("accumulation overhead (median over processes, range as bars)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "overhead.png", dpi=110)
    print(f"wrote {OUT / 'overhead.md'} and {OUT / 'overhead.png'}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
