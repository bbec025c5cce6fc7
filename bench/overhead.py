"""Seconds per optimizer step: a hand-written loop, gradaccum, Accelerate, Lightning Fabric.

A small byte-level transformer LM (the `gpt` recipe's GPT with 2 layers, d_model 128,
128-byte sequences), the same micro-batches for all four, AdamW, 2 threads pinned. Each
window is N micro-batches of 8 sequences. The four take turns window by window (rotating
who goes first) after 3 warm-up windows each; medians of 41 windows each; ratios to the hand
loop, the lower bound (no validation, no normalization by count, no norm, no guard),
as a ratio of medians and as the median of per-window paired ratios.

Writes bench/results/overhead.md and bench/results/overhead.png.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from peers import IMPLEMENTATIONS

import gradaccum as ga
from gradaccum.recipes.gpt import GPT, GPTConfig
from gradaccum.recipes.stdlib_text import corpus_bytes, full_length_batch

OUT = Path(__file__).parent / "results"
MICRO, NS, WARMUP, REPEATS = 8, [1, 4, 8], 3, 41


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(max_len=128, d_model=128, n_heads=4, n_layers=2))


def mean_loss(m, mb):
    logits = m(mb["input_ids"])[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             mb["labels"][:, 1:].reshape(-1))  # fmt: skip


def sum_loss(m, mb):
    return ga.causal_lm_loss(m(mb["input_ids"]), mb["labels"])


def measure(n: int, data: bytes) -> tuple[dict[str, float], dict[str, float]]:
    runners = []
    for impl in IMPLEMENTATIONS:
        net = model()
        runners.append(impl(net, torch.optim.AdamW(net.parameters(), lr=1e-3), n))
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for w in range(WARMUP + REPEATS):
        micro = ga.split(full_length_batch(data, MICRO * n, 128, seed=w), MICRO)
        order = runners[w % len(runners) :] + runners[: w % len(runners)]
        for r in order:
            start = time.perf_counter()
            r.window(micro, mean_loss, sum_loss)
            if w >= WARMUP:
                times[r.name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    # Each window's time over the hand loop's in the same round: drift cancels.
    hand = times["hand loop"]
    paired = {
        name: statistics.median(a / b for a, b in zip(t, hand, strict=True))
        for name, t in times.items()
    }
    return medians, paired


def main() -> None:
    torch.set_num_threads(2)
    data = corpus_bytes()
    measured = {n: measure(n, data) for n in NS}
    results = {n: m for n, (m, _) in measured.items()}
    paired = {n: p for n, (_, p) in measured.items()}
    names = [impl.name for impl in IMPLEMENTATIONS]
    import accelerate
    import lightning

    lines = [
        "# Overhead: seconds per optimizer step",
        "",
        f"GPT 2 layers, d_model 128, micro-batches of {MICRO} x 128 bytes, AdamW. Machine: "
        f"{platform.machine()}, 2 threads, torch {torch.__version__}, accelerate "
        f"{accelerate.__version__}, lightning {lightning.__version__}, Python "
        f"{sys.version.split()[0]}. Median of {REPEATS} windows after {WARMUP} warm-up, the "
        "four taking turns.",
        "",
        "| N | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in NS:
        base = results[n]["hand loop"]
        lines.append(
            f"| {n} | "
            + " | ".join(f"{results[n][k]:.4f} s ({results[n][k] / base:.3f}x)" for k in names)
            + " |"
        )
    lines += [
        "",
        "Ratios are to the hand loop in the same run: ratio of medians above; below, the "
        "median over windows of each window's time over the hand loop's in the same round "
        "(drift of the shared machine cancels).",
        "",
        "| N | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in NS:
        lines.append(f"| {n} | " + " | ".join(f"{paired[n][k]:.3f}x" for k in names) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.2
    for i, name in enumerate(names):
        ax.bar(
            [j + i * width for j in range(len(NS))],
            [paired[n][name] for n in NS],
            width,
            label=name,
        )
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks([j + 1.5 * width for j in range(len(NS))], [f"N={n}" for n in NS])
    ax.set_ylabel("seconds per step / hand loop (median paired)")
    ax.set_title("accumulation overhead (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "overhead.png", dpi=110)
    print(f"wrote {OUT / 'overhead.md'} and {OUT / 'overhead.png'}")


if __name__ == "__main__":
    main()
