"""The fastest plan against every size that fits (issue 46).

For the gpt, segment and minilm recipes and a tiny GPT-2 with LoRA adapters (built here from
a config, no hub), each at two budgets and a small effective batch: `ga.plan` with
`prefer="largest"` (the plan before: the largest that fits, untimed) and with
`prefer="fastest"` (its candidates' memory and seconds per effective batch, and its choice),
then an exhaustive sweep as the reference: every size from 1 to the largest that fits (as a
plan's fresh process measured it, not as its line extrapolates), one real window of the
whole effective batch each (ragged last micro-batch where the size does not divide)
through a fresh Accumulator, all sizes taking turns (in order, then reversed) for
FASTEST_ROUNDS rounds (default 3). The choice should be within 5% of the sweep's
fastest; where the fastest is not the largest, the table says by how much. Planning time
before and after is each plan's own seconds (`ga.plan` in this process, the largest size
measured in a fresh process, as `gradaccum plan` does).

One case plans with `checkpointing="auto"` at a budget where activation checkpointing fits a
larger size than the largest without it: the fastest plan measures the checkpointed line
too and races its size; the sweep times the sizes that fit only with checkpointing with it
on, and the case says what measuring the checkpointed line took of the planning.

Writes bench/results/fastest.md. `python bench/fastest.py gpt` runs one case.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import gradaccum as ga
from gradaccum.app.measure import fresh_process_verifier
from gradaccum.batching import take
from gradaccum.memory import format_bytes
from gradaccum.planning.speed import window_sizes

OUT = Path(__file__).parent / "results"
ROUNDS = int(os.environ.get("FASTEST_ROUNDS", "3"))


def recipe(name: str, folder: Path):
    from gradaccum.app.recipes import get_recipe

    r = get_recipe(name)

    def verifier(sample):
        return fresh_process_verifier(name)

    return r.build_model, r.sample_batch, r.loss_fn, verifier


def lora_gpt2(folder: Path):
    """A GPT-2 of 4 layers, width 128, a 2,000-token vocabulary and 128 positions, with
    LoRA adapters of rank 8 on its attention (PEFT); random token ids. Saved to ``folder``
    for the fresh process that verifies its plan (it applies the same adapters)."""
    import transformers

    from gradaccum.integrations.peft import apply_lora

    config = transformers.GPT2Config(
        vocab_size=2000, n_positions=128, n_embd=128, n_layer=4, n_head=4
    )
    lora = {"r": 8, "alpha": None, "dropout": 0.0, "targets": None}
    path = folder / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)

    def build():
        return apply_lora(transformers.GPT2LMHeadModel.from_pretrained(path), **lora)

    def sample(n: int):
        ids = torch.randint(0, 2000, (n, 128), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids.clone()}

    def loss_fn(model, mb):
        return ga.causal_lm_loss(model(input_ids=mb["input_ids"]).logits, mb["labels"])

    def verifier(batch):
        saved = folder / "sample.pt"
        torch.save(batch, saved)
        return fresh_process_verifier(None, hf_model=str(path), lora=lora, sample=str(saved))

    return build, sample, loss_fn, verifier


# name: (what builds it, effective batch, budgets, the plans' other settings)
CASES = {
    "gpt": (partial(recipe, "gpt"), 16, ("100MB", "250MB"), {}),
    "segment": (partial(recipe, "segment"), 8, ("400MB", "700MB"), {}),
    "minilm": (partial(recipe, "minilm"), 16, ("800MB", "1GB"), {}),
    "gpt2 LoRA": (lora_gpt2, 16, ("150MB", "300MB"), {}),
    # without checkpointing 100MB fits 6 or 7 of 16; with it, more
    "gpt checkpointing": (partial(recipe, "gpt"), 16, ("100MB",), {"checkpointing": "auto"}),
}


def sweep(model, optimizer, sample, loss_fn, per_rank: int, sizes: list[int], checkpointed=()):
    """Seconds per effective batch of every size, ROUNDS rounds taking turns: a window of
    the whole per-rank batch at each size, after one untimed window each; the sizes in
    ``checkpointed`` with activation checkpointing on."""
    acc = ga.Accumulator(model, optimizer)
    batches = {s: [take(sample, m) for m in window_sizes(per_rank, s)] for s in sizes}

    def window(s: int) -> float:
        if s in checkpointed:
            ga.enable_checkpointing(model)
        try:
            began = time.perf_counter()
            acc.step(batches[s], loss_fn)
            return time.perf_counter() - began
        finally:
            ga.disable_checkpointing(model)

    for s in sizes:
        window(s)
    seconds = {s: [] for s in sizes}
    for r in range(ROUNDS):
        for s in sizes if r % 2 == 0 else sizes[::-1]:
            seconds[s].append(window(s))
    return seconds


def case(name: str) -> list[str]:
    build, effective, budgets, settings = CASES[name]
    with tempfile.TemporaryDirectory(prefix="fastest-") as tmp:
        return _case(name, build(Path(tmp)), effective, budgets, settings)


def _case(name: str, built, effective: int, budgets, settings) -> list[str]:
    make, sample_batch, loss_fn, verifier = built
    rows = []
    for budget in budgets:
        torch.manual_seed(0)
        model = make()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        sample = sample_batch(8)
        kw = dict(effective_batch=effective, budget=budget, **settings)
        plans = {}
        try:
            for prefer in ("largest", "fastest"):
                # as `gradaccum plan` plans: the largest size measured in a fresh process
                with verifier(sample) as verify:
                    plans[prefer] = ga.plan(
                        model, optimizer, sample, loss_fn, prefer=prefer, verify=verify, **kw
                    )
        except ValueError as err:
            rows.append(f"### {name} at {budget}: {err}\n")
            continue
        before, after = plans["largest"], plans["fastest"]
        # What fits is what a plan measured to fit (a fresh process at the largest size),
        # not its line's extrapolation (largest_fitting), which the measurement may refuse.
        # Two plans, two measurements: on the CPU the resident bytes at a budget's edge move
        # by a few MiB from one process to the next, so they may differ by a size; the sweep
        # covers the larger, and the choice is judged among the sizes its own plan measured
        # to fit (the sizes it could choose from), the gap said where they differ.
        fits = max([t.micro_size for t in after.timings] + [after.micro_size])
        top = max(before.micro_size, fits)
        sizes = list(range(top, 0, -1))
        # the sizes above the largest that fits without checkpointing fit only with it
        plain_top = max(
            [t.micro_size for t in after.timings if not t.checkpointed] + [before.micro_size]
        )
        raced_ckpt = any(t.checkpointed for t in after.timings)
        ckpt = {s for s in sizes if s > plain_top} if raced_ckpt else set()
        began = time.perf_counter()
        swept = sweep(model, optimizer, sample, loss_fn, before.per_rank_batch, sizes, ckpt)
        sweep_s = time.perf_counter() - began
        med = {s: statistics.median(v) for s, v in swept.items()}
        fastest = min((s for s in med if s <= fits), key=med.get)
        chosen = after.micro_size
        edge = (
            f" The plan before measured {top} to fit, the plan after only {fits} (its fresh "
            f"process at {top} read above the budget): the choice is judged among 1 to {fits}; "
            f"{top} takes {med[top] / med[fastest]:.2f}x the time of {fastest}."
            if top > fits
            else ""
        )
        within = med[chosen] / med[fastest] - 1
        raced = [n for n in after.notes if n.startswith("activation checkpointing")]
        ckpt_said = (
            f" The checkpointed line: {raced[0]}; the sweep times {min(ckpt)} to {max(ckpt)} "
            "with checkpointing on (they fit only with it)."
            if raced and ckpt
            else (f" The checkpointed line: {raced[0]}." if raced else "")
        )
        rows.append(
            f"### {name}, effective batch {effective}, budget {budget}\n\n"
            f'Planning: {before.seconds:.1f} s before (`prefer="largest"`: micro-batch '
            f'{before.micro_size}), {after.seconds:.1f} s after (`prefer="fastest"`: '
            f"micro-batch {chosen}; {after.choice or 'untimed: one size fits'}); "
            f"{after.seconds / before.seconds:.2f}x; the timing itself "
            f"{after.timing_seconds:.1f} s, "
            f"{after.timing_seconds / max(after.seconds - after.timing_seconds, 1e-9):.0%} "
            f"of the rest of its plan.{ckpt_said}\n\n"
            f"The plan's candidates:\n\n{after.timing_table()}\n\n"
            f"The sweep ({ROUNDS} rounds, {sweep_s:.0f} s): every size from 1 to the largest "
            f"that fits, {top}, seconds per effective batch, median [range]:\n\n"
            "| micro-batch | s per effective batch | vs the sweep's fastest | |\n"
            "|---:|---:|---:|---|\n"
            + "\n".join(
                f"| {s} | {med[s]:.3g} [{min(swept[s]):.3g}, {max(swept[s]):.3g}] | "
                f"{med[s] / med[fastest]:.2f}x | "
                + ", ".join(
                    mark
                    for mark, on in (
                        ("fastest", s == fastest),
                        ("the plan's choice", s == chosen),
                        ("largest", s == top),
                        ("checkpointed", s in ckpt),
                    )
                    if on
                )
                + " |"
                for s in sizes
            )
            + f"\n\n**The choice, {chosen}, is {within:+.1%} from the sweep's fastest, "
            f"{fastest}** ({'within' if within <= 0.05 else 'NOT within'} 5%)"
            + (
                f"; the fastest is not the largest: the largest, {top}, takes "
                f"{med[top] / med[fastest]:.2f}x its time."
                if fastest != top
                else "; the largest is the fastest."
            )
            + f" Predicted peak at the choice: {format_bytes(after.predicted_peak)} of "
            f"{format_bytes(after.budget * (1 - after.margin))} usable.{edge}\n"
        )
        summary.append(
            f"| {name} | {budget} | {before.micro_size} | {chosen} | {fastest} | "
            f"{within:+.1%} | {med[top] / med[fastest]:.2f}x | {before.seconds:.1f} s | "
            f"{after.seconds:.1f} s | {after.timing_seconds:.1f} s |"
        )
        print(rows[-1], flush=True)
    return rows


summary: list[str] = []


def main() -> None:
    torch.set_num_threads(int(os.environ.get("FASTEST_THREADS", "2")))
    names = sys.argv[1:] or list(CASES)
    began = time.perf_counter()
    sections = [row for name in names for row in case(name)]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load = os.getloadavg()
    text = "\n".join(
        [
            "# The fastest plan against every size that fits",
            "",
            f"`python bench/fastest.py` at gradaccum {commit} on {platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads; load average at the end {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; "
            f"{time.perf_counter() - began:.0f} s in all. Each case: `ga.plan` with "
            '`prefer="largest"` (before) and `prefer="fastest"` (after) in this process, '
            "then every size from 1 to the largest that fits timed over the whole effective "
            f"batch, {ROUNDS} rounds taking turns (the reference).",
            "",
            "| case | budget | largest (before) | chosen (after) | sweep's fastest | choice "
            "vs fastest | largest vs fastest | planning before | after | of it, timing |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *summary,
            "",
            *sections,
        ]
    )
    OUT.mkdir(exist_ok=True)
    (OUT / "fastest.md").write_text(text + "\n")
    print(f"wrote {OUT / 'fastest.md'}")


if __name__ == "__main__":
    main()
