"""torch.compile under the Accumulator: compile time, seconds per window against eager, the
graphs compiled over epochs with a ragged last window, and the gradient against eager.

The `gpt` recipe's GPT (2 layers, d_model 128, 128-byte sequences), padded sequences of
16..128 bytes; an epoch of 200 sequences in windows of 64 as micro-batches of 16 (each window
16, 16, 16, 16; the last window of 8 as one micro-batch of 8: a ragged end), SGD at lr 0 so
every window sees the same weights. Eager and compiled (the default backend, Inductor, with
torch's default dynamic=None) share the model's parameters.

- *compile*: the first window's seconds through the compiled forward (tracing and Inductor
  included) and the graphs a counting backend saw compiled, over 3 epochs;
- *seconds per window*: after the first epoch, full windows taking turns eager / compiled,
  the median of each window's seconds and of the compiled-over-eager ratio per round, with
  an eager-over-eager control (the machine's noise);
- *gradient*: each window's accumulated gradient, compiled against eager, relative error.

Writes bench/results/compile.md and compile.json. A few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import describe

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig

OUT = Path(__file__).parent / "results"
SEQ, MICRO, WINDOW, EPOCH, EPOCHS, ROUNDS = 128, 16, 64, 200, 3, 15


def data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (EPOCH, SEQ), generator=g)
    lengths = torch.randint(16, SEQ + 1, (EPOCH,), generator=g)
    labels = ids.masked_fill(torch.arange(SEQ)[None] >= lengths[:, None], -100)
    return {"input_ids": ids, "labels": labels}


def loss_with(module):
    def loss_fn(_model, mb):
        logits = module(mb["input_ids"])[:, :-1]
        labels = mb["labels"][:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        return loss, (labels != -100).sum()

    return loss_fn


def windows(batch):
    for start in range(0, EPOCH, WINDOW):
        yield ga.split({k: v[start : start + WINDOW] for k, v in batch.items()}, MICRO)


def main() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_len=SEQ, d_model=128, n_heads=4, n_layers=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handed: list[torch.Tensor] = []  # the gradient each step is handed (the Accumulator
    # clears it after the step)
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: handed.append(
            torch.cat([p.grad.flatten() for g in opt.param_groups for p in g["params"]])
        )
    )
    acc = ga.Accumulator(model, optimizer)
    compiled_shapes: list[tuple[int, ...]] = []

    def counting(gm, example_inputs):
        shape = next((tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)), ())
        compiled_shapes.append(shape)
        return torch._inductor.compile(gm, example_inputs)

    eager, compiled = loss_with(model), loss_with(torch.compile(model, backend=counting))
    batch = data()
    errors, first, firsts = [], None, []
    for epoch in range(EPOCHS):
        for mbs in windows(batch):
            acc.step(mbs, eager)
            start = time.perf_counter()
            acc.step(mbs, compiled)
            took = time.perf_counter() - start
            want, got = handed[-2], handed[-1]
            if first is None:
                first = took
            if epoch == 0:
                firsts.append(took)
            errors.append(float((got - want).norm() / want.norm()))
    graphs_after_first_epoch = len(compiled_shapes)
    ways = {"eager": eager, "eager (control)": eager, "compiled": compiled}
    times: dict[str, list[float]] = {n: [] for n in ways}
    full = next(windows(batch))
    for r in range(ROUNDS):
        names = list(ways)
        for name in names[r % 3 :] + names[: r % 3]:
            start = time.perf_counter()
            acc.step(full, ways[name])
            times[name].append(time.perf_counter() - start)
    ratio = {
        n: statistics.median(t / e for t, e in zip(times[n], times["eager"], strict=True))
        for n in ways
    }
    result = {
        "first_window_seconds": first,
        "first_epoch_window_seconds": firsts,
        "graphs": len(compiled_shapes),
        "graphs_after_first_epoch": graphs_after_first_epoch,
        "graph_shapes": compiled_shapes,
        "median_seconds": {n: statistics.median(t) for n, t in times.items()},
        "ratio_to_eager": ratio,
        "max_gradient_error": max(errors),
        "torch": torch.__version__,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "compile.json").write_text(json.dumps(result, indent=1) + "\n")
    med = result["median_seconds"]
    lines = [
        "# torch.compile under the Accumulator",
        "",
        f"`python bench/compile.py`. {describe()}",
        "",
        f"The `gpt` recipe's GPT (2 layers, d_model 128), epochs of {EPOCH} padded sequences "
        f"of 16..{SEQ} bytes in windows of {WINDOW} as micro-batches of {MICRO} (the last "
        f"window {EPOCH % WINDOW}: a ragged end), SGD at lr 0; torch.compile with the default "
        "backend (Inductor) and dynamic=None, sharing the model's parameters.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| first window, compiled (tracing and compiling included) | {first:.1f} s |",
        "| windows of the first epoch, compiled | "
        + ", ".join(f"{t:.1f}" for t in firsts)
        + " s |",
        f"| graphs compiled over {EPOCHS} epochs (after the first) | {len(compiled_shapes)} "
        f"({graphs_after_first_epoch}) |",
        f"| median s / window, eager | {med['eager']:.3f} |",
        f"| median s / window, compiled | {med['compiled']:.3f} |",
        f"| compiled / eager (median of per-round ratios) | {ratio['compiled']:.3f} |",
        f"| eager control / eager (the noise) | {ratio['eager (control)']:.3f} |",
        f"| largest relative gradient error, compiled against eager, over {len(errors)} "
        f"windows | {max(errors):.1e} |",
        "",
        f"Graph shapes (the first input of each compiled graph): {compiled_shapes}.",
        "",
    ]
    (OUT / "compile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
