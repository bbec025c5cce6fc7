"""What named terms cost against today's single division: seconds per window and peak memory.

The `gpt` recipe's GPT (2 layers, d_model 128, 128-byte sequences), windows of 4
micro-batches of 8 sequences with padding (lengths 16..128, so every micro-batch counts a
different number of tokens), SGD. Four ways to run the same window:

- *pair*: one ``(loss_sum, count)``, divided once at the window's end (today's contract);
- *pair (control)*: the same again, its ratio to *pair* is the machine's noise floor;
- *one term*: the same cross-entropy as one named term with ``counts=`` (the terms'
  arithmetic alone: the count function, the counts' all-reduce, the coefficient);
- *three terms*: cross-entropy per token, per sequence (weight 0.5) and a z-loss over
  routed tokens (weight 0.01), each divided by its own count (the extra losses' compute
  included).

The four take turns window by window (rotating who goes first) after 3 warm-up windows each,
in one process sharing one model; each window's time is divided by the *pair*'s in the same
round, and the median of those ratios is reported. Peak memory per window: live tensor bytes
(``LiveTensorBytes``, deterministic) above the window's start.

Writes bench/results/terms.md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import describe

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.memory import LiveTensorBytes

OUT = Path(__file__).parent / "results"
MICRO, N, WARMUP, ROUNDS, SEQ = 8, 4, 3, 41, 128


def window(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (MICRO * N, SEQ), generator=g)
    lengths = torch.randint(16, SEQ + 1, (MICRO * N,), generator=g)
    labels = ids.masked_fill(torch.arange(SEQ)[None] >= lengths[:, None], -100)
    return ga.split({"input_ids": ids, "labels": labels}, MICRO)


def parts(model, mb):
    logits = model(mb["input_ids"])[:, :-1]
    labels = mb["labels"][:, 1:]
    mask = labels != -100
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none"
    ).reshape(labels.shape)
    return logits, ce, mask


def pair(model, mb):
    _, ce, mask = parts(model, mb)
    return ga.per_token(ce, mask)


def one_term(model, mb):
    return {"ce": pair(model, mb)}


def one_count(mb):
    return {"ce": ga.token_count(mb["labels"][:, 1:] != -100)}


def three_terms(model, mb):
    logits, ce, mask = parts(model, mb)
    routed = mask & (mb["input_ids"][:, 1:] % 2 == 0)
    z = torch.logsumexp(logits, dim=-1).square()
    return {
        "ce": ga.per_token(ce, mask),
        "seq": (*ga.per_sequence(ce, mask), 0.5),
        "z": (*ga.per_token(z, routed), 0.01),
    }


def three_counts(mb):
    mask = mb["labels"][:, 1:] != -100
    routed = mask & (mb["input_ids"][:, 1:] % 2 == 0)
    return {"ce": ga.token_count(mask), "seq": ga.sequence_count(mask), "z": ga.token_count(routed)}


WAYS = {
    "pair": (pair, None),
    "pair (control)": (pair, None),
    "one term": (one_term, one_count),
    "three terms": (three_terms, three_counts),
}


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_len=SEQ, d_model=128, n_heads=4, n_layers=2))
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    names = list(WAYS)
    for name in names:
        for w in range(WARMUP):
            acc.step(window(w), *WAYS[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS):
        batch = window(100 + r)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            acc.step(batch, *WAYS[name])
            times[name].append(time.perf_counter() - start)
    ratios = {
        n: statistics.median(t / p for t, p in zip(times[n], times["pair"], strict=True))
        for n in names
    }
    peaks = {}
    for name in names:
        with LiveTensorBytes() as meter:
            acc.step(window(7), *WAYS[name])
        peaks[name] = meter.peak
    lines = [
        "# Named terms against the single division",
        "",
        f"`python bench/terms.py`. {describe()}",
        "",
        f"The `gpt` recipe's GPT (2 layers, d_model 128), windows of {N} micro-batches of "
        f"{MICRO} padded sequences of 16..{SEQ} bytes, SGD; {ROUNDS} rounds, the ways taking "
        "turns window by window. Time: the median over rounds of each window's seconds over "
        "the *pair*'s in the same round. Memory: live tensor bytes above the window's start.",
        "",
        "| way | median s / window | ratio to pair | peak tensor memory of a window |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {statistics.median(times[name]):.4f} | {ratios[name]:.3f} "
            f"| {ga.memory.format_bytes(peaks[name])} |"
        )
    lines += [
        "",
        "*pair (control)* is the same computation as *pair*: its distance from 1 is the noise "
        "floor of this machine. *one term* is the terms' arithmetic alone (a count function "
        "over the window before its first backward, the counts summed over ranks, each loss "
        "times its coefficient): no gradient buffer is added, so its memory is the pair's "
        "plus a few scalars. *three terms* adds the two other losses' own compute.",
    ]
    OUT.mkdir(exist_ok=True)
    (OUT / "terms.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
