"""Peak memory and seconds per optimizer step vs N for the MiniLM fine-tuning recipe, and
its plan at the default budget.

The pretrained all-MiniLM-L6-v2 classifier (22.7M parameters, every one trained) at the
recipe's effective batch of 256 docstrings, as N micro-batches of 256 / N for N = 1, 2, 4,
8, 16, each N in a fresh process (``vs_n``: how it is measured), on the first 256 training
docstrings of seed 0 (each micro-batch cut to its own longest docstring, as training runs
them); then the plan at the recipe's default budget, verified in two fresh processes as
``gradaccum train`` verifies it on CPU.

Writes bench/results/minilm.md and bench/results/minilm.png.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import vs_n
from machine import describe

from gradaccum.memory import format_bytes, parse_bytes
from gradaccum.recipes.minilm import DEFAULTS

EFFECTIVE = DEFAULTS["effective_batch"]


def main() -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = vs_n.rows_for(__file__)
    plan = vs_n.planned("minilm")
    print(plan.summary(), flush=True)
    load_after = os.getloadavg()[0]
    by_n = {r["n"]: r for r in rows}
    budget = parse_bytes(DEFAULTS["budget"])
    fits = vs_n.fits(rows, budget)
    lines = [
        "# MiniLM fine-tuning: peak memory and time per step vs N",
        "",
        f"Recipe `minilm` (pretrained all-MiniLM-L6-v2, every parameter trained, AdamW, fp32), "
        f"effective batch {EFFECTIVE} docstrings (the first {EFFECTIVE} of the training order, "
        f"up to 64 tokens); each N in a fresh process, {vs_n.TIMED} timed windows after one "
        f"warm-up. {describe(vs_n.threads())} Run {datetime.date.today().isoformat()}; the "
        f"machine is shared: load average {load_before:.1f} before, {load_after:.1f} after (2 "
        "cores), so the seconds vary from run to run; the fastest of the timed windows is the "
        "least disturbed by other work.",
        "",
        *vs_n.table(rows),
        "",
        f"Peak resident memory is parameters and buffers plus how far the process's resident "
        f"set rose while training (what `--budget` bounds on CPU); the budget it needs keeps "
        f"the planner's {vs_n.MARGIN:.0%} margin free. The recipe's default budget, "
        f"{DEFAULTS['budget']}, holds "
        + (f"N = {', '.join(map(str, fits))} of these" if fits else "none of these N")
        + f" (its plan, below: {plan.micro_batches} micro-batches of {plan.micro_size}); "
        f"N = 1 needs {format_bytes(by_n[1]['peak'] / (1 - vs_n.MARGIN))}. Sixteen "
        f"micro-batches take {by_n[1]['peak'] / by_n[16]['peak']:.1f}x less memory than one "
        f"batch of {EFFECTIVE} and {by_n[16]['fastest'] / by_n[1]['fastest']:.2f}x its time "
        "per step (fastest windows), for the same gradient. Parameters, gradients and AdamW's "
        "two states (22.7M x 4 x 4 bytes, 347 MiB) stay whatever N is: only the activations "
        "shrink.",
        "",
        "The plan at the default budget (`gradaccum.plan`, the planned size verified in two "
        "fresh processes, as `gradaccum train` does on CPU):",
        "",
        "```",
        plan.summary(),
        "```",
        "",
        plan.table(),
    ]
    vs_n.OUT.mkdir(parents=True, exist_ok=True)
    (vs_n.OUT / "minilm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    vs_n.plot(rows, vs_n.OUT / "minilm.png", EFFECTIVE, budget, DEFAULTS["budget"])
    print(f"wrote bench/results/minilm.md and .png in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(vs_n.measure("minilm", EFFECTIVE, int(sys.argv[2]), lr=1e-4)))
    else:
        main()
