"""Time each implementation adds per optimizer step, with the compute made small.

overhead.py times real windows, where what a tool adds (well under 1 ms) sits inside ~2% of
machine noise. Here the same model (the `gpt` recipe's GPT, 2 layers, d_model 128: the
optimizer and every gradient pass stay full size) runs micro-batches of one 4-byte sequence,
so a window is mostly what the tools do around forward and backward. All implementations wrap
one shared model and optimizer and take turns round by round; each cell is the median over
ROUNDS of the window's time minus the hand loop's in the same round, with a 95% bootstrap
interval. The control is a second, identical hand loop.

Writes bench/results/overhead_added.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch
from machine import describe
from overhead import RUNNERS, mean_loss, model, sum_loss

import gradaccum as ga
from gradaccum.app.recipes.stdlib_text import corpus_bytes, full_length_batch

OUT = Path(__file__).parent / "results"
NS, WARMUP, ROUNDS = [1, 8], 20, 800
PEERS = ["Accelerate", "Lightning Fabric"]


def added(n: int, data: bytes, rounds: int = ROUNDS) -> dict[str, tuple[float, float, float]]:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    runners = [impl(net, optimizer, n) for impl in RUNNERS]
    micro = ga.split(full_length_batch(data, n, 4, seed=0), 1)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for w in range(WARMUP + rounds):
        for r in runners[w % len(runners) :] + runners[: w % len(runners)]:
            start = time.perf_counter()
            r.window(micro, mean_loss, sum_loss)
            if w >= WARMUP:
                times[r.name].append(time.perf_counter() - start)
    out = {
        name: (*paired_difference(t, times["hand loop"]), statistics.median(t) * 1e6)
        for name, t in times.items()
    }
    for name in PEERS:  # gradaccum against each peer directly, round by round
        out[f"gradaccum - {name}"] = paired_difference(times["gradaccum"], times[name])
    return out


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median over rounds of a's window time minus b's in the same round, in microseconds,
    with a 95% bootstrap interval (1,000 resamples, seeded)."""
    diffs = [(x - y) * 1e6 for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(1000))
    return statistics.median(diffs), boot[25], boot[974]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="measured rounds per N")
    parser.add_argument("--n", type=int, nargs="+", default=NS, help="micro-batches per window")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (2, as committed; 1 on a machine others load: two threads then "
        "wait on each other for most of each window)",
    )
    args = parser.parse_args()
    ns, rounds = args.n, args.rounds
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # the machine is shared: how busy it was when the run began
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    data = corpus_bytes()
    results = {}
    for n in ns:
        results[n] = added(n, data, rounds)
        print(f"N={n} done", flush=True)
    names = [impl.name for impl in RUNNERS if impl.name != "hand loop"]
    lines = [
        "# Time added per optimizer step, over a minimal hand-written loop",
        "",
        f"GPT 2 layers, d_model 128 (0.45M parameters), AdamW, micro-batches of one 4-byte "
        f"sequence. {describe(threads=args.threads, peers=True)} {rounds} rounds after {WARMUP} "
        "warm-up, "
        f"the implementations taking turns. gradaccum at commit {commit}; load average "
        f"{load:.1f} when the run began (a shared machine: compare within this table).",
        "",
        "Microseconds added per window: median over rounds of (window time - the hand loop's "
        "in the same round), with a 95% bootstrap interval. The hand loop's own window time "
        "is in the last column.",
        "",
        "| N | " + " | ".join(names) + " | hand loop window |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for n in ns:
        r = results[n]
        cells = [f"{r[k][0]:+.0f} us [{r[k][1]:+.0f}, {r[k][2]:+.0f}]" for k in names]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {r['hand loop'][3]:.0f} us |")
    lines += [
        "",
        "gradaccum against each peer directly: median over rounds of (gradaccum's window time "
        "- the peer's in the same round), with a 95% bootstrap interval; below zero, "
        "gradaccum adds less.",
        "",
        "| N | " + " | ".join(f"gradaccum - {p}" for p in PEERS) + " |",
        "|---:|" + "---:|" * len(PEERS),
    ]
    for n in ns:
        r = results[n]
        cells = []
        for p in PEERS:
            mid, low, high = r[f"gradaccum - {p}"]
            cells.append(f"{mid:+.0f} us [{low:+.0f}, {high:+.0f}]")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "gradaccum's part: per window a norm over the gradients (the skip policy and "
        "`grad_norm`), the decision and one division by the window's count, all on the "
        "gradient's device, the window's losses summed, then one read of the window's numbers "
        "(the hand loop folds its 1/N into each loss instead, which only works when the count "
        "is known in advance), and per micro-batch the count and the checks. Accelerate's is "
        "mostly per micro-batch (its `accumulate` context and `backward`), Fabric's per "
        "micro-batch and per step (its wrappers).",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "overhead_added.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
