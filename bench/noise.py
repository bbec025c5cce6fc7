"""What the gradient noise scale costs: seconds per optimizer step with it on and off.

The `gpt` recipe (byte GPT, 4 layers), effective batch 64 in 4 micro-batches of 16, AdamW,
2 threads. The two settings alternate window by window in ABBA order after a warm-up, so
drift of the machine and allocator churn hit both alike; medians of 60 windows each, and
the median of the 60 paired ratios (on / off within a step), the steadier number.

Writes bench/results/noise.md and bench/results/noise.png.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import gradaccum as ga
from gradaccum.app.recipes import get_recipe

OUT = Path(__file__).parent / "results"
REPEATS, MICRO, EFFECTIVE = 60, 16, 64


def main() -> None:
    torch.set_num_threads(2)
    recipe = get_recipe("gpt")
    data = recipe.make_data(0)
    runs = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = recipe.build_model()
        acc = ga.Accumulator(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            noise=ga.NoiseScale() if on else None,
        )
        runs[on] = {"acc": acc, "times": []}
    for step in range(3):  # warm-up
        for run in runs.values():
            batch = ga.split(data.batch(step * EFFECTIVE, EFFECTIVE), MICRO)
            run["acc"].step(batch, recipe.loss_fn)
    for step in range(3, 3 + REPEATS):
        batch = ga.split(data.batch(step * EFFECTIVE, EFFECTIVE), MICRO)
        # ABBA order: whichever runs second in a step pays for the first one's memory churn
        for on in (False, True) if step % 2 else (True, False):
            run = runs[on]
            start = time.perf_counter()
            result = run["acc"].step(batch, recipe.loss_fn)
            run["times"].append(time.perf_counter() - start)
            run["last"] = result.noise_scale
    off, on = (statistics.median(runs[k]["times"]) for k in (False, True))
    pairs = zip(runs[True]["times"], runs[False]["times"], strict=True)
    paired = statistics.median(a / b for a, b in pairs)
    lines = [
        "# Gradient noise scale: overhead",
        "",
        f"Recipe `gpt`, effective batch {EFFECTIVE} in {EFFECTIVE // MICRO} micro-batches of "
        f"{MICRO}, AdamW. Machine: {platform.machine()}, 2 threads, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}. Median of {REPEATS} windows each, in ABBA order.",
        "",
        "| noise scale | median s / step | ratio of medians | median paired ratio | B_simple |",
        "|---|---:|---:|---:|---:|",
        f"| off | {off:.4f} | 1.000 | 1.000 | - |",
        f"| on | {on:.4f} | {on / off:.3f} | {paired:.3f} | {runs[True]['last']:.0f} |",
        "",
        "Off computes nothing (no hook is registered either way). On, after each micro-batch "
        "one fused norm reads the gradient summed so far (a prefix of the window), and the "
        "window's norm is the one clipping computes anyway.",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.boxplot([runs[False]["times"], runs[True]["times"]], tick_labels=["off", "on"])
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title(f"noise scale overhead: median paired ratio {paired:.3f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "noise.png", dpi=110)
    print(f"wrote {OUT / 'noise.md'} and {OUT / 'noise.png'}")


if __name__ == "__main__":
    main()
