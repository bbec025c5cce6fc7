"""The large-batch trade-off, reproduced by accumulation: optimizer steps and samples to a
fixed held-out loss against the effective batch, the McCandlish et al. (2018) curve fitted
to them, and the critical batch it implies set beside the noise scale gradaccum reads in the
same runs.

Two tasks of different kinds, every effective batch run exactly by accumulation at one
micro-batch size:

- gpt: the byte GPT of `make demo` (next-token loss per byte), micro-batches of 4,
  effective batches 4 to 128 sequences of 128 bytes, to a held-out loss of 3.0;
- digits: the CNN on scikit-learn's 8x8 digits (loss per image), micro-batches of 8,
  effective batches 8 to 256 images, to a held-out loss of 0.12.

Each run is `gradaccum train` (AdamW, warm-up over the same samples whatever the batch, then
cosine decay over a horizon of samples the same for every batch) stopped when its held-out
loss reaches the task's target (`--target-loss`), evaluated every 16 sequences or 32
images (every step from those batches up), so the crossing is placed to within a few steps
(linear interpolation between the two evaluations around it). Learning rates: a sweep of
three on seed 0 around the square-root rule, extended while the best (fewest steps to the
target) is at an edge; the best then runs on further seeds.

The fit: S = S_min (1 + B_crit / B), i.e. S = S_min + E_min / B, a straight line in 1/B
(least squares on relative error); B_crit = E_min / S_min, its interval from resampling the
seeds of every batch (bootstrap, 2,000 draws, 90%). The noise scale: B_simple as gradaccum
reads it (`noise_scale`, `noise_low`, `noise_high` in metrics.jsonl, in the loss's items)
at the evaluation where each best-rate run reaches the target, in samples (items / items
per sample), the median over the runs that have a reading then (a window of one
micro-batch has none; a reading needs some windows first).

Writes bench/results/tradeoff.md and bench/results/tradeoff.png. About an hour on 2 cores;
runs are kept in $TRADEOFF_CACHE (default the temp folder) by their arguments, so a rerun
redraws the report at once. `python bench/tradeoff.py digits` runs (and reports) one task;
TRADEOFF_CACHED_ONLY=1 draws the report from the cached runs alone, leaving out (and naming)
the batches not measured yet.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TRADEOFF_CACHE", Path(tempfile.gettempdir()) / "gradaccum-tradeoff"))
SEEDS = (0, 1, 2)
RUN_SECONDS: list[float] = []  # each run's training seconds (from its metrics, cached or not)


@dataclass(frozen=True)
class Task:
    name: str
    args: tuple[str, ...]
    micro: int
    batches: tuple[int, ...]
    target: float  # held-out loss to reach
    lr64: float  # the sweep's centre at 64, scaled by the square root of the batch
    horizon: int  # samples of the cosine decay, every batch alike (and the most a run trains)
    warmup_samples: int
    eval_samples: int  # an evaluation about every this many samples (at least every step)
    item: str  # what the loss averages over
    items_per_sample: float  # to read B_simple (in items) in samples


TASKS = {
    "digits": Task(
        "digits", ("--recipe", "digits"), 8, (8, 16, 32, 64, 128, 256), 0.12, 3e-3, 40_960,
        256, 32, "image", 1.0,
    ),
    "gpt": Task(
        "gpt", (), 4, (4, 8, 16, 32, 64, 128), 3.0, 3e-3, 40_960, 256, 16, "byte", 127.0
    ),
}  # fmt: skip


class NotCached(Exception):
    """With TRADEOFF_CACHED_ONLY set: a run the cache does not hold (the report leaves its
    batch out and says so)."""


def run(task: Task, batch: int, lr: float, seed: int) -> list[dict]:
    """One `gradaccum train` to the task's target; its metrics lines (kept in CACHE)."""
    every = max(1, round(task.eval_samples / batch))
    warmup = max(1, round(task.warmup_samples / batch))
    args = [
        *task.args,
        "--effective-batch", batch, "--micro-batch", task.micro, "--lr", f"{lr:.6g}",
        "--warmup-steps", warmup, "--samples", task.horizon, "--eval-every", every,
        "--target-loss", task.target, "--checkpoint-every", 1_000_000, "--seed", seed,
    ]  # fmt: skip
    args = [str(a) for a in args]
    key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:20]
    cached = CACHE / f"{task.name}-{key}.json"
    if not cached.is_file() and os.environ.get("TRADEOFF_CACHED_ONLY"):
        raise NotCached(f"{task.name} batch {batch} lr {lr:.2e} seed {seed}")
    if cached.is_file():
        lines = json.loads(cached.read_text())
        RUN_SECONDS.append(sum(x["seconds"] for x in lines))
        return lines
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gradaccum", "train", *args, "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(lines))
    RUN_SECONDS.append(sum(x["seconds"] for x in lines))
    return lines


@dataclass
class Reached:
    steps: float
    samples: float
    noise: tuple[float, float, float] | None  # B_simple and its interval, in items


def reach(lines: list[dict], target: float) -> Reached | None:
    """Steps and samples at which the held-out loss first reaches ``target``, interpolated
    linearly between the evaluations around it; the noise reading at that step."""
    before = (0.0, 0.0, None)  # (step, samples, loss) of the previous evaluation
    for x in lines:
        if "eval_loss" not in x:
            continue
        point = (float(x["step"]), float(x["samples"]), x["eval_loss"])
        if point[2] <= target:
            if before[2] is None:
                steps, samples = point[0], point[1]
            else:
                f = (before[2] - target) / (before[2] - point[2])
                steps = before[0] + f * (point[0] - before[0])
                samples = before[1] + f * (point[1] - before[1])
            noise = None
            if x.get("noise_scale") is not None and x.get("noise_low") is not None:
                noise = (x["noise_scale"], x["noise_low"], x["noise_high"])
            return Reached(steps, samples, noise)
        before = point
    return None


def sweep(task: Task, batch: int, log) -> tuple[float, dict[float, Reached | None]]:
    """Seed 0 at three rates around the square-root rule, one more beyond an edge while the
    best is there (at most two more): the rate with the fewest steps to the target."""
    centre = task.lr64 * math.sqrt(batch / 64)
    todo, tried, extra = [centre / 2, centre, centre * 2], {}, 0
    while todo:
        lr = todo.pop(0)
        tried[lr] = reach(run(task, batch, lr, 0), task.target)
        got = tried[lr]
        log(f"  {task.name} batch {batch} lr {lr:.2e}: " + (
            f"{got.steps:.1f} steps, {got.samples:,.0f} samples" if got else "not reached"
        ))  # fmt: skip
        if not todo and extra < 2:
            ok = {r: v.steps for r, v in tried.items() if v is not None}
            if ok:
                best = min(ok, key=ok.get)
                if best == min(tried):
                    todo.append(best / 2)
                elif best == max(tried):
                    todo.append(best * 2)
                extra += bool(todo)
    ok = {r: v.steps for r, v in tried.items() if v is not None}
    return (min(ok, key=ok.get) if ok else centre), tried


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(S_min, E_min) of S = S_min + E_min / B through (B, S) points, least squares on the
    relative error (each equation divided by its S)."""
    a = [[1 / s, 1 / (b * s)] for b, s in points]
    y = [1.0] * len(points)
    # normal equations of a 2-parameter linear least squares
    s11 = sum(r[0] * r[0] for r in a)
    s12 = sum(r[0] * r[1] for r in a)
    s22 = sum(r[1] * r[1] for r in a)
    t1 = sum(r[0] * v for r, v in zip(a, y, strict=True))
    t2 = sum(r[1] * v for r, v in zip(a, y, strict=True))
    det = s11 * s22 - s12 * s12
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def bootstrap(per_batch: dict[int, list[float]], draws: int = 2000) -> list[float]:
    """B_crit of fits to the seeds of each batch resampled with replacement (medians)."""
    rng = random.Random(0)
    out = []
    for _ in range(draws):
        points = []
        for b, steps in per_batch.items():
            picked = [rng.choice(steps) for _ in steps]
            points.append((b, statistics.median(picked)))
        s_min, e_min = fit(points)
        if s_min > 0 and e_min > 0:
            out.append(e_min / s_min)
    return sorted(out)


def quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def study(task: Task, log) -> dict:
    rows, per_batch, noise = [], {}, []
    missing = []
    for batch in task.batches:
        try:
            lr, tried = sweep(task, batch, log)
            runs = [tried[lr]] + [reach(run(task, batch, lr, s), task.target) for s in SEEDS[1:]]
        except NotCached:
            missing.append(batch)
            continue
        got = [r for r in runs if r is not None]
        log(
            f"  {task.name} batch {batch} at {lr:.2e}: steps "
            + ", ".join("-" if r is None else f"{r.steps:.1f}" for r in runs)
        )
        rows.append({"batch": batch, "lr": lr, "runs": runs, "tried": tried})
        if len(got) == len(runs):
            per_batch[batch] = [r.steps for r in got]
        noise += [r.noise for r in got if r.noise is not None and batch >= 2 * task.micro]
    points = [(b, statistics.median(s)) for b, s in per_batch.items()]
    s_min, e_min = fit(points) if len(points) >= 2 else (float("nan"), float("nan"))
    crit = bootstrap(per_batch) if len(points) >= 2 else []
    b_noise = None
    if noise:
        b_noise = tuple(
            statistics.median(n[i] for n in noise) / task.items_per_sample for i in range(3)
        )
    return {
        "task": task,
        "rows": rows,
        "points": points,
        "s_min": s_min,
        "e_min": e_min,
        "crit": crit,
        "b_noise": b_noise,
        "missing": missing,
    }


def agree(result: dict) -> str:
    crit, noise = result["crit"], result["b_noise"]
    if not crit or noise is None:
        return "cannot say (no fit or no reading)"
    lo, hi = quantile(crit, 0.05), quantile(crit, 0.95)
    if noise[2] < lo or noise[1] > hi:
        ratio = result["e_min"] / result["s_min"] / noise[0]
        return f"they disagree: the intervals do not overlap (critical / B_simple = {ratio:.2f})"
    spread = noise[2] / noise[1] if noise[1] > 0 else math.inf
    if spread > 4:
        return (
            f"they agree: the intervals overlap, but B_simple's spans a factor of {spread:.0f} "
            "(readings at the target come from few windows), so this is a weak test"
        )
    return "they agree: the intervals overlap"


def write(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# The large-batch trade-off, reproduced by accumulation",
        "",
        f"Measured by `bench/tradeoff.py` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, 2 threads per run; "
        f"{len(RUN_SECONDS)} runs, {sum(RUN_SECONDS) / 60:.0f} minutes of training in all "
        "(the machine was shared while they ran: time is not what this bench compares).",
        "",
        "Each effective batch is run exactly by accumulating micro-batches of one size (the "
        "same for every batch of a task), to a fixed held-out loss, each at its best learning "
        "rate of a sweep on seed 0 (fewest steps to the target), then on seeds 1 and 2. *Steps* "
        "and *samples* are the medians over seeds of when the held-out loss first reached the "
        "target (interpolated between evaluations). The fit is McCandlish et al.'s "
        "S = S_min (1 + B_crit / B), E = E_min (1 + B / B_crit), B_crit = E_min / S_min; its "
        "interval resamples the seeds (90%). B_simple is the noise scale gradaccum read in "
        "the same runs at the target (median over the best-rate runs that had a reading then; "
        "its interval the medians of the readings' 90% intervals), in samples.",
        "",
    ]
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    for k, res in enumerate(results):
        task = res["task"]
        lines += [
            f"## {task.name}: held-out loss {task.target} (loss per {task.item})",
            "",
            "| effective batch | best lr | steps to target (seeds 0, 1, 2) | median steps | "
            "median samples | rates tried (steps on seed 0) |",
            "|---:|---:|---|---:|---:|---|",
        ]
        for row in res["rows"]:
            runs = row["runs"]
            done = [r for r in runs if r is not None]
            steps = ", ".join("not reached" if r is None else f"{r.steps:.1f}" for r in runs)
            med_s = f"{statistics.median(r.steps for r in done):.1f}" if done else "-"
            med_e = f"{statistics.median(r.samples for r in done):,.0f}" if done else "-"
            tried = ", ".join(
                f"{lr:.1e}: " + ("-" if v is None else f"{v.steps:.0f}")
                for lr, v in sorted(row["tried"].items())
            )
            lines.append(
                f"| {row['batch']} | {row['lr']:.2e} | {steps} | {med_s} | {med_e} | {tried} |"
            )
        s_min, e_min, crit, noise = res["s_min"], res["e_min"], res["crit"], res["b_noise"]
        lines.append("")
        if res["missing"]:
            lines += [
                "Not measured yet, so not in the fit: effective batch "
                + ", ".join(map(str, res["missing"]))
                + " (the report was drawn from the runs cached so far).",
                "",
            ]
        if crit:
            lines.append(
                f"Fit: S_min = {s_min:.1f} steps, E_min = {e_min:,.0f} samples; **critical "
                f"batch E_min / S_min = {e_min / s_min:.1f} samples** (90% interval "
                f"{quantile(crit, 0.05):.1f} to {quantile(crit, 0.95):.1f}, {len(crit)} "
                "resamples with a positive fit)."
            )
        else:
            lines.append("Fit: fewer than two batches reached the target on every seed.")
        if noise is not None:
            lines.append(
                f"Noise scale read in the same runs: **B_simple = {noise[0]:.1f} samples** "
                f"({noise[1]:.1f} to {noise[2]:.1f}; {noise[0] * task.items_per_sample:,.0f} "
                f"{task.item}s)."
            )
        lines += ["", f"**{agree(res)}.**", ""]
        ax1, ax2 = axes[k]
        pts = res["points"]
        for row in res["rows"]:
            for r in row["runs"]:
                if r is not None:
                    ax1.scatter(r.samples, r.steps, s=12, color="C0", alpha=0.5)
                    ax2.scatter(row["batch"], r.steps, s=12, color="C0", alpha=0.5)
        if crit:
            bs = [2 ** (i / 8) for i in range(8 * 2, 8 * 10)]
            ax1.plot(
                [e_min * (1 + b / (e_min / s_min)) for b in bs],
                [s_min * (1 + (e_min / s_min) / b) for b in bs],
                "C1",
                label=f"fit: S_min {s_min:.0f}, E_min {e_min:,.0f}",
            )
            ax2.plot(bs, [s_min + e_min / b for b in bs], "C1", label="fit")
            ax2.plot(bs, [e_min / b for b in bs], "C2--", lw=1, label="perfect scaling (E_min / B)")
            ax2.axvline(e_min / s_min, color="C1", ls=":", label=f"B_crit {e_min / s_min:.0f}")
        if noise is not None:
            ax2.axvspan(noise[1], noise[2], color="C3", alpha=0.15, label="B_simple interval")
            ax2.axvline(noise[0], color="C3", lw=1, label=f"B_simple {noise[0]:.0f}")
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylabel("optimizer steps to target")
            ax.legend(fontsize=8)
        ax1.set_xlabel("samples to target")
        ax2.set_xlabel("effective batch (samples)")
        ax1.set_title(f"{task.name}: steps against samples (McCandlish)")
        ax2.set_title(f"{task.name}: steps against batch (Shallue)")
        if pts:
            ax2.set_xlim(min(b for b, _ in pts) / 1.5, max(b for b, _ in pts) * 1.5)
    fig.tight_layout()
    fig.savefig(OUT / "tradeoff.png", dpi=110)
    lines += ["![steps against samples and against the batch](tradeoff.png)", ""]
    (OUT / "tradeoff.md").write_text("\n".join(lines))


def main() -> None:
    names = sys.argv[1:] or list(TASKS)
    results = []
    for name in names:
        print(f"{name}:", flush=True)
        results.append(study(TASKS[name], lambda s: print(s, flush=True)))
    for res in results:
        print(res["task"].name, res["s_min"], res["e_min"], res["b_noise"], agree(res))
    write(results)


if __name__ == "__main__":
    main()
