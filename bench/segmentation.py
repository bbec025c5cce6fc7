"""Peak memory and seconds per optimizer step vs N for the segmentation recipe.

The U-Net (GroupNorm) on 256x256 images at an effective batch of 32, as N micro-batches of
32 / N for N = 1, 2, 4, 8, 16. Each N runs in a fresh process, so one N's peak cannot hide
under another's: a warm-up window, then timed windows (the median is reported), all under
the resident-memory meter the planner's budget is written in (``TrainingMemory``: the
parameters' and buffers' bytes plus how far the resident set rose); then one window under
the live-tensor meter (what CUDA's allocator would count) and the bytes one micro-batch
saves for backward. The budget column is what the planner would need to choose that N:
the peak with its 15% margin kept free. Last, the plan at the recipe's default budget, its
planned size verified in two fresh processes as ``gradaccum train`` verifies it on CPU.
And the gradient of one window (16 micro-batches of 2) against the full batch of 32 at the
recipe's 256x256, in float64 (fp32's own rounding of a full batch is ~1e-3 here, so it
cannot show 1e-6): GroupNorm, BatchNorm, and BatchNorm after ``convert_batchnorm``.

Writes bench/results/segmentation.md and bench/results/segmentation.png.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import describe

import gradaccum as ga
from gradaccum.memory import (
    LiveTensorBytes,
    TrainingMemory,
    format_bytes,
    parse_bytes,
    saved_activation_bytes,
)
from gradaccum.recipes.segmentation import (
    DEFAULTS,
    SIZE,
    SegmentationData,
    segmentation_loss,
    segmentation_recipe,
)

OUT = Path(__file__).parent / "results"
EFFECTIVE, NS = 32, [1, 2, 4, 8, 16]
TIMED = 5  # windows timed per N, after one warm-up window
MARGIN = 0.15  # the planner's default


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "2"))


def one(n: int) -> dict:
    """Measure N micro-batches per window, in this (fresh) process."""
    torch.set_num_threads(threads())
    recipe = segmentation_recipe()
    micro = EFFECTIVE // n
    batch = SegmentationData(0).batch(0, EFFECTIVE)
    torch.manual_seed(0)
    model = recipe.build_model()
    acc = ga.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    memory = TrainingMemory(model, "cpu")
    seconds = []
    for i in range(1 + TIMED):
        start = time.perf_counter()
        acc.step(ga.split(batch, micro), recipe.loss_fn)
        if i:
            seconds.append(time.perf_counter() - start)
    peak = memory.peak()
    # a copy: a slice would count the whole batch's storage as saved (the first conv's input)
    first = tuple(t.clone() for t in ga.split(batch, micro)[0])
    with saved_activation_bytes(model) as act:
        loss_sum, _ = recipe.loss_fn(model, first)
    del loss_sum
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as live:
        acc.step(ga.split(batch, micro), recipe.loss_fn)
    return {
        "n": n,
        "micro": micro,
        "peak": peak,
        "live": live.peak,
        "activations": act[0],
        "median": statistics.median(seconds),
        "fastest": min(seconds),
        "seconds": seconds,
    }


def exactness() -> dict[str, float]:
    """Largest relative error over the parameters between one window's gradient (16 x 2,
    through the Accumulator) and the full batch of 32's (plain autograd on the mean pixel
    loss), float64, 256x256, for each normalization."""
    import torch.nn.functional as F

    torch.set_num_threads(threads())
    images, masks = SegmentationData(0).batch(0, EFFECTIVE)
    batch = (images.double(), masks)
    out = {}
    for name in ("GroupNorm", "BatchNorm", "BatchNorm after convert_batchnorm"):
        grads = []
        for accumulate in (False, True):
            torch.manual_seed(0)
            model = segmentation_recipe("group" if name == "GroupNorm" else "batch").build_model()
            if "convert" in name:
                ga.convert_batchnorm(model)
            model.double()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            if accumulate:
                seen = {}
                optimizer.register_step_pre_hook(
                    lambda opt, args, kwargs, m=model, seen=seen: seen.update(
                        {n: p.grad.clone() for n, p in m.named_parameters()}
                    )
                )
                ga.Accumulator(model, optimizer).step(ga.split(batch, 2), segmentation_loss)
                grads.append(seen)
            else:
                F.cross_entropy(model(batch[0]), batch[1]).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        out[name] = worst(*grads)
        if name == "GroupNorm":  # fp32's own rounding of the same full batch, for scale
            torch.manual_seed(0)
            model = segmentation_recipe("group").build_model()
            F.cross_entropy(model(images), masks).backward()
            fp32 = {n: p.grad.double() for n, p in model.named_parameters()}
            out["GroupNorm, the full batch in fp32 (not a window)"] = worst(grads[0], fp32)
    return out


def worst(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """Largest relative error over the parameters (the norm of the difference over the
    reference's)."""
    return max(
        float((other[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-300))
        for k in reference
    )


def training_peak(micro: int, micro_batches: int, windows: int = 3) -> int:
    """What ``gradaccum.measure`` reports for a recipe: the training peak of a few windows
    from a fresh process's first step."""
    torch.set_num_threads(threads())
    recipe = segmentation_recipe()
    batch = recipe.sample_batch(micro * micro_batches)
    torch.manual_seed(0)
    model = recipe.build_model()
    acc = ga.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    memory = TrainingMemory(model, "cpu")
    for _ in range(windows):
        acc.step(ga.split(batch, micro), recipe.loss_fn)
    return memory.peak()


def planned() -> ga.Plan:
    """The plan at the recipe's default budget, as ``gradaccum train`` makes it on CPU: the
    planned size verified in two fresh processes."""

    def verify(micro: int, micro_batches: int, checkpointing: bool) -> int:
        return max(fresh("--peak", micro, micro_batches) for _ in range(2))

    torch.set_num_threads(threads())
    recipe = segmentation_recipe()
    torch.manual_seed(0)
    model = recipe.build_model()
    return ga.plan(
        model,
        torch.optim.AdamW(model.parameters(), lr=DEFAULTS["lr"]),
        recipe.sample_batch(8),
        recipe.loss_fn,
        effective_batch=DEFAULTS["effective_batch"],
        budget=DEFAULTS["budget"],
        verify=verify,
    )


def fresh(*args: object):
    proc = subprocess.run(
        [sys.executable, __file__, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads())},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = []
    for n in NS:
        rows.append(fresh("--one", n))
        print(rows[-1], flush=True)
    plan = planned()
    print(plan.summary(), flush=True)
    exact = fresh("--exact")
    print(exact, flush=True)
    load_after = os.getloadavg()[0]
    by_n = {r["n"]: r for r in rows}
    budget = parse_bytes(DEFAULTS["budget"])
    slowdown = by_n[16]["fastest"] / by_n[1]["fastest"]
    saved = by_n[1]["peak"] / by_n[16]["peak"]
    fits = [r["n"] for r in rows if r["peak"] <= budget * (1 - MARGIN)]
    lines = [
        "# Segmentation: peak memory and time per step vs N",
        "",
        f"Recipe `segment` (U-Net, GroupNorm, {SIZE}x{SIZE} procedural images), effective batch "
        f"{EFFECTIVE}, AdamW, fp32; each N in a fresh process, {TIMED} timed windows after one "
        f"warm-up. {describe(threads())} Run {datetime.date.today().isoformat()}; the machine is "
        f"shared: load average {load_before:.1f} before, {load_after:.1f} after (2 cores), so "
        "the seconds vary from run to run; the fastest of the timed windows is the least "
        "disturbed by other work.",
        "",
        "| N | micro-batch | peak resident (training) | budget it needs | live tensor peak | "
        "activations saved per micro-batch | seconds per step: fastest | median |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['n']} | {r['micro']} | {format_bytes(r['peak'])} | "
            f"{format_bytes(r['peak'] / (1 - MARGIN))} | {format_bytes(r['live'])} | "
            f"{format_bytes(r['activations'])} | {r['fastest']:.2f} | {r['median']:.2f} |"
            for r in rows
        ],
        "",
        f"Peak resident memory is parameters and buffers plus how far the process's resident "
        f"set rose while training (what `--budget` bounds on CPU); the budget it needs keeps the "
        f"planner's {MARGIN:.0%} margin free. The recipe's default budget, "
        f"{DEFAULTS['budget']}, holds N = {', '.join(map(str, fits)) or 'none'} of these; N = 1 "
        f"needs {format_bytes(by_n[1]['peak'] / (1 - MARGIN))}. Sixteen micro-batches of 2 "
        f"take {saved:.1f}x less memory than one batch of {EFFECTIVE} and {slowdown:.2f}x its "
        "time per step (fastest windows), for the same gradient.",
        "",
        "The plan at the default budget (`gradaccum.plan`, the planned size verified in two "
        "fresh processes, as `gradaccum train` does on CPU):",
        "",
        "```",
        plan.summary(),
        "```",
        "",
        plan.table(),
        "",
        f"One window of 16 micro-batches of 2 against the full batch of {EFFECTIVE}, at "
        f"{SIZE}x{SIZE} in float64 (largest relative error over the parameters: the norm of "
        "the difference over the norm of the full batch's gradient). The recipe trains in "
        "fp32, whose own rounding of the full batch (last row) is far above 1e-6 at this "
        "size, so exactness is shown where the arithmetic can show it:",
        "",
        "| model | against the full batch in float64 |",
        "|---|---:|",
        *[f"| {name} | {err:.1e} |" for name, err in exact.items()],
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "segmentation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(11, 4.2))
    mem.plot(NS, [r["peak"] / mib for r in rows], marker="o", label="peak resident (training)")
    mem.plot(NS, [r["live"] / mib for r in rows], marker="s", label="live tensor peak")
    mem.plot(NS, [r["activations"] / mib for r in rows], marker="^", label="activations (1 micro)")
    mem.axhline(
        budget * (1 - MARGIN) / mib,
        color="gray",
        linestyle="--",
        label=f"default budget {DEFAULTS['budget']} less {MARGIN:.0%} margin",
    )
    mem.set_yscale("log", base=2)
    mem.set_ylabel("MiB")
    mem.set_title(f"effective batch {EFFECTIVE}: peak memory vs N")
    sec.plot(NS, [r["fastest"] for r in rows], marker="o", color="C3", label="fastest")
    sec.plot(NS, [r["median"] for r in rows], marker="s", color="C1", label="median")
    sec.legend(fontsize=8)
    sec.set_ylim(bottom=0)
    sec.set_ylabel(f"seconds per optimizer step ({TIMED} timed)")
    sec.set_title(f"{threads()} torch threads: time per step vs N")
    for ax in (mem, sec):
        ax.set_xscale("log", base=2)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.set_xlabel(f"micro-batches per window N (micro-batch = {EFFECTIVE} / N)")
        ax.grid(alpha=0.3)
    mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "segmentation.png", dpi=110)
    print(
        f"wrote {OUT / 'segmentation.md'} and {OUT / 'segmentation.png'} "
        f"in {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(int(sys.argv[2]))))
    elif sys.argv[1:2] == ["--exact"]:
        print(json.dumps(exactness()))
    elif sys.argv[1:2] == ["--peak"]:
        print(json.dumps(training_peak(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
