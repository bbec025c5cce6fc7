"""Peak memory and seconds per optimizer step against N at one effective batch, for a
built-in recipe: what bench/segmentation.py and bench/minilm.py measure (a helper module:
it measures nothing when run alone).

Each N runs in a fresh process (``python SCRIPT --one N``), so one N's peak cannot hide
under another's: a warm-up window, then timed windows (fastest and median reported), all
under the resident-memory meter the planner's budget is written in (``TrainingMemory``: the
parameters' and buffers' bytes plus how far the resident set rose); then one window under
the live-tensor meter (what CUDA's allocator would count) and the bytes one micro-batch
saves for backward. The budget column is what the planner would need to choose that N: the
peak with its 15% margin kept free.
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
from typing import Any

import torch

import gradaccum as ga
from gradaccum.app.recipes import get_recipe
from gradaccum.batching import map_tensors
from gradaccum.memory import LiveTensorBytes, TrainingMemory, format_bytes, saved_activation_bytes

OUT = Path(__file__).parent / "results"
NS = [1, 2, 4, 8, 16]
TIMED = 5  # windows timed per N, after one warm-up window
MARGIN = 0.15  # the planner's default


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "2"))


def measure(recipe_name: str, effective: int, n: int, lr: float) -> dict[str, Any]:
    """N micro-batches per window of the recipe's first ``effective`` training samples, in
    this (fresh) process."""
    torch.set_num_threads(threads())
    recipe = get_recipe(recipe_name)
    micro = effective // n
    batch = recipe.make_data(0).batch(0, effective)
    torch.manual_seed(0)
    model = recipe.build_model()
    acc = ga.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=lr))
    memory = TrainingMemory(model, "cpu")
    seconds = []
    for i in range(1 + TIMED):
        start = time.perf_counter()
        acc.step(ga.split(batch, micro), recipe.loss_fn)
        if i:
            seconds.append(time.perf_counter() - start)
    peak = memory.peak()
    # a copy: a slice would count the whole batch's storage as saved (the first layer's input)
    first = map_tensors(ga.split(batch, micro)[0], lambda t: t.clone())
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


def fresh(script: str, *args: object) -> Any:
    """``python SCRIPT ARGS`` in a fresh process; its last stdout line, as JSON."""
    proc = subprocess.run(
        [sys.executable, script, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads())},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows_for(script: str) -> list[dict[str, Any]]:
    rows = []
    for n in NS:
        rows.append(fresh(script, "--one", n))
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    return [
        "| N | micro-batch | peak resident (training) | budget it needs | live tensor peak | "
        "activations saved per micro-batch | seconds per step: fastest | median |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['n']} | {r['micro']} | {format_bytes(r['peak'])} | "
            f"{format_bytes(r['peak'] / (1 - MARGIN))} | {format_bytes(r['live'])} | "
            f"{format_bytes(r['activations'])} | {r['fastest']:.2f} | {r['median']:.2f} |"
            for r in rows
        ],
    ]


def fits(rows: list[dict[str, Any]], budget: int) -> list[int]:
    """The N whose measured peak fits ``budget`` less the planner's margin."""
    return [r["n"] for r in rows if r["peak"] <= budget * (1 - MARGIN)]


def plot(
    rows: list[dict[str, Any]], path: Path, effective: int, budget: int, budget_name: str
) -> None:
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
        label=f"default budget {budget_name} less {MARGIN:.0%} margin",
    )
    mem.set_yscale("log", base=2)
    mem.set_ylabel("MiB")
    mem.set_title(f"effective batch {effective}: peak memory vs N")
    sec.plot(NS, [r["fastest"] for r in rows], marker="o", color="C3", label="fastest")
    sec.plot(NS, [r["median"] for r in rows], marker="s", color="C1", label="median")
    sec.legend(fontsize=8)
    sec.set_ylim(bottom=0)
    sec.set_ylabel(f"seconds per optimizer step ({TIMED} timed)")
    sec.set_title(f"{threads()} torch threads: time per step vs N")
    for ax in (mem, sec):
        ax.set_xscale("log", base=2)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.set_xlabel(f"micro-batches per window N (micro-batch = {effective} / N)")
        ax.grid(alpha=0.3)
    mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def planned(recipe_name: str) -> ga.Plan:
    """The plan at the recipe's default budget, as ``gradaccum train`` makes it on CPU: its
    probes in this process, the planned size verified in two fresh processes
    (``gradaccum.app.measure``)."""
    from gradaccum.app.measure import fresh_process_verifier

    torch.set_num_threads(threads())
    recipe = get_recipe(recipe_name)
    defaults = recipe.defaults
    torch.manual_seed(0)
    model = recipe.build_model()
    with fresh_process_verifier(recipe_name) as verify:
        return ga.plan(
            model,
            torch.optim.AdamW(model.parameters(), lr=defaults["lr"]),
            recipe.sample_batch(8),
            recipe.loss_fn,
            effective_batch=defaults["effective_batch"],
            budget=defaults["budget"],
            verify=verify,
        )


def plan_lines(plan: ga.Plan) -> list[str]:
    """The plan at the default budget, as the results files show it."""
    return [
        "The plan at the default budget (`gradaccum.planning`, the planned size verified in two "
        "fresh processes, as `gradaccum train` does on CPU):",
        "",
        "```",
        plan.summary(),
        "```",
        "",
        plan.table(),
    ]


def write(
    name: str,
    lines: list[str],
    rows: list[dict[str, Any]],
    effective: int,
    budget: str,
    started: float,
) -> None:
    """results/NAME.md from ``lines`` (printed too) and results/NAME.png from ``rows``."""
    from gradaccum.memory import parse_bytes

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, OUT / f"{name}.png", effective, parse_bytes(budget), budget)
    print(f"wrote bench/results/{name}.md and .png in {time.perf_counter() - started:.0f} s")


def how(load_before: float, load_after: float) -> str:
    """How the N were run, and on what (the second half of a results file's first line)."""
    from machine import describe

    return (
        f"each N in a fresh process, {TIMED} timed windows after one warm-up. "
        f"{describe(threads())} Run {datetime.date.today().isoformat()}; the machine is "
        f"shared: load average {load_before:.1f} before, {load_after:.1f} after (2 cores), so "
        "the seconds vary from run to run; the fastest of the timed windows is the least "
        "disturbed by other work."
    )


def budget_text(rows: list[dict[str, Any]], budget: str) -> str:
    """What the peaks mean, and which N the recipe's default budget holds."""
    from gradaccum.memory import parse_bytes

    held = fits(rows, parse_bytes(budget))
    first = next(r for r in rows if r["n"] == 1)
    return (
        "Peak resident memory is parameters and buffers plus how far the process's resident "
        "set rose while training (what `--budget` bounds on CPU); the budget it needs keeps "
        f"the planner's {MARGIN:.0%} margin free. The recipe's default budget, {budget}, holds "
        + (f"N = {', '.join(map(str, held))} of these" if held else "none of these N")
        + f"; N = 1 needs {format_bytes(first['peak'] / (1 - MARGIN))}."
    )


def window_gradients(
    model: torch.nn.Module, batch: Any, micro: int, loss_fn: Any
) -> dict[str, torch.Tensor]:
    """The gradient an Accumulator hands the optimizer after one window of ``batch`` in
    micro-batches of ``micro`` (the optimizer is SGD at lr 0: ``model`` keeps its values)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.update(
            {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}
        )
    )
    ga.Accumulator(model, optimizer).step(ga.split(batch, micro), loss_fn)
    return seen


def worst_tensor(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], skip: frozenset[str] = frozenset()
) -> float:
    """The largest relative error over the parameters (the norm of the difference over the
    norm of ``want``), those in ``skip`` aside."""
    return max(
        float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-300))
        for k in want
        if k not in skip
    )
