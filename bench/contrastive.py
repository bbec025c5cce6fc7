"""In-batch negatives at a large batch: cached gradients (ga.InBatch) against plain accumulation.

The `minilm-pairs` recipe (pretrained all-MiniLM-L6-v2, pairs of consecutive docstring
paragraphs of a stdlib module, multiple-negatives ranking loss at scale 20): an effective
batch of 1,024 pairs per step as micro-batches of MICRO pairs (fixed here; the recipe's 2GB
budget plans 23 on 2 CPU cores: a batch of 1,024 fits only as many micro-batches), trained
twice from the same weights on the same pairs in the same order:

- *cached*: ``ga.InBatch``: each query against the 1,023 other positives of its step;
- *plain*: the same loss over each micro-batch alone, accumulated: each query against the
  MICRO - 1 others of its micro-batch (what plain accumulation of a contrastive loss does).

AdamW at lr 2e-5, one warm-up step, STEPS steps. Held-out retrieval (each held-out query's
positive among all held-out positives: accuracy at 1, and the ranking loss) before training
and every EVAL_EVERY steps. Seconds per window, each mode's median.

Then memory, with live tensor bytes (``LiveTensorBytes``, deterministic; slow, so on a
smaller window): one plain step of a micro-batch of MEM_MICRO pairs, a cached window of
MEM_N such micro-batches, and the full batch of MEM_N x MEM_MICRO pairs in one step.

Writes bench/results/contrastive.md and contrastive.json. About 25 minutes on 2 cores.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from machine import describe

import gradaccum as ga
from gradaccum.app.recipes import minilm_pairs as recipe
from gradaccum.memory import LiveTensorBytes, format_bytes

OUT = Path(__file__).parent / "results"
EFFECTIVE, MICRO, STEPS, EVAL_EVERY, LR = 1024, 64, 8, 2, 2e-5
MEM_MICRO, MEM_N = 16, 4


def plain(model, mb):
    return recipe.LOSS(model, mb)  # the loss over this micro-batch alone


def train(mode: str, data: recipe.PairData, log) -> dict:
    torch.manual_seed(0)
    model = recipe.PairEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    acc = ga.Accumulator(model, optimizer, scheduler=scheduler)
    loss_fn = recipe.LOSS if mode == "cached" else plain
    curve = [{"step": 0, **data.evaluate(model, MICRO)}]
    log(f"{mode}: step 0 {curve[-1]}")
    seconds, losses = [], []
    for step in range(1, STEPS + 1):
        batch = data.batch((step - 1) * EFFECTIVE, EFFECTIVE)
        start = time.perf_counter()
        result = acc.step(ga.split(batch, MICRO), loss_fn)
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
        if step % EVAL_EVERY == 0:
            curve.append({"step": step, **data.evaluate(model, MICRO)})
            log(f"{mode}: step {step} {seconds[-1]:.1f} s {curve[-1]}")
    return {"curve": curve, "seconds": seconds, "train_loss": losses}


def window_memory(data: recipe.PairData) -> dict[str, int]:
    torch.manual_seed(0)
    model = recipe.PairEncoder()
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = data.batch(0, MEM_MICRO * MEM_N)
    acc.step(ga.split(batch, MEM_MICRO), recipe.LOSS)  # warm: kernels' first allocations
    peaks = {}
    ways = {
        f"one micro-batch of {MEM_MICRO} pairs (plain step)": (
            [data.batch(0, MEM_MICRO)],
            plain,
        ),
        f"plain window of {MEM_N} x {MEM_MICRO} pairs": (ga.split(batch, MEM_MICRO), plain),
        f"cached window of {MEM_N} x {MEM_MICRO} pairs": (ga.split(batch, MEM_MICRO), recipe.LOSS),
        f"the full batch of {MEM_N * MEM_MICRO} pairs in one step": ([batch], plain),
    }
    for name, (micro_batches, loss_fn) in ways.items():
        with LiveTensorBytes() as meter:
            acc.step(micro_batches, loss_fn)
        peaks[name] = meter.peak
    return peaks


def main() -> None:
    torch.set_num_threads(2)
    started = time.time()

    def log(line: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {line}", flush=True)

    data = recipe.PairData(seed=0)
    runs = {mode: train(mode, data, log) for mode in ("cached", "plain")}
    peaks = window_memory(data)
    OUT.mkdir(exist_ok=True)
    (OUT / "contrastive.json").write_text(json.dumps({"runs": runs, "memory": peaks}, indent=1))
    held = len(data.held_out["query_ids"])
    lines = [
        "# In-batch negatives at 1,024 pairs: cached gradients against plain accumulation",
        "",
        f"`python bench/contrastive.py`. {describe()}",
        "",
        f"The `minilm-pairs` recipe's data and loss: {data.epoch_samples():,} training pairs, "
        f"{held:,} held-out pairs (whole modules). Effective batch {EFFECTIVE:,} pairs as "
        f"micro-batches of {MICRO}, AdamW lr {LR:g}, {STEPS} steps, the same weights and the "
        "same pairs in the same order for both. Held-out accuracy: each held-out query's "
        f"positive retrieved among all {held:,} held-out positives (at 1); loss: the ranking "
        "loss over the whole held-out set.",
        "",
        "| step | cached: accuracy | cached: loss | plain: accuracy | plain: loss |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c, p in zip(runs["cached"]["curve"], runs["plain"]["curve"], strict=True):
        lines.append(
            f"| {c['step']} | {c['accuracy']:.3f} | {c['loss']:.3f} "
            f"| {p['accuracy']:.3f} | {p['loss']:.3f} |"
        )
    cached_s = statistics.median(runs["cached"]["seconds"])
    plain_s = statistics.median(runs["plain"]["seconds"])
    lines += [
        "",
        f"Seconds per window (median of {STEPS}): cached {cached_s:.1f} s, plain "
        f"{plain_s:.1f} s: {cached_s / plain_s:.2f}x (the cached window embeds every "
        "micro-batch twice: one forward without a graph, one with).",
        "",
        f"Peak live tensor bytes above the step's start (an SGD step, {MEM_MICRO}-pair "
        "micro-batches):",
        "",
        "| step | peak tensor memory |",
        "|---|---:|",
        *(f"| {name} | {format_bytes(v)} |" for name, v in peaks.items()),
        "",
        "A window of several micro-batches holds one summed gradient more than a single "
        "step while the next micro-batch's gradient is computed (any accumulation does); a "
        "cached window adds the window's embeddings and their gradient (2 x 384 floats per "
        "pair) to a plain window and holds one micro-batch's activations at a time; the full "
        "batch in one step holds every pair's activations at once.",
    ]
    (OUT / "contrastive.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
