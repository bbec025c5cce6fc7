"""Targets and limits on the default recipe, from the command line as a user runs them.

1. `gradaccum train --target-loss 2.7 --eval-every 10`: the default run (planned for its 512MB
   budget) stops at the first evaluation at or below 2.7, checkpointed.
2. `gradaccum train --max-time 20s`: stops after 20 s of training, evaluated and
   checkpointed; `--resume` with `--max-time 40s` continues, counting the first session.

Writes bench/results/targets.md. Takes about 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def gradaccum(*args: object) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        check=True,
    )
    return proc.stdout


def outcome(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    evals = [
        (x["step"], round(x["eval_loss"], 4))
        for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in x
    ]
    return {
        "stopped_by": summary["stopped_by"],
        "steps": summary["steps"],
        "checkpoint_step": saved["step"],
        "held_out_loss": summary["held_out_loss"],
        "targets": {k: v for k, v in summary["targets"].items() if v["status"] != "not set"},
        "evaluations": evals,
    }


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "target"
        log = gradaccum("train", "--target-loss", 2.7, "--eval-every", 10, "--out", run)
        results["target_loss"] = outcome(run)
        results["target_loss"]["log"] = [x for x in log.splitlines() if x.startswith("stopping")]
        run = Path(tmp) / "time"
        gradaccum("train", "--max-time", "20s", "--out", run)
        results["max_time"] = outcome(run)
        gradaccum("train", "--resume", run, "--max-time", "40s")
        results["max_time_resumed"] = outcome(run)
    results["machine"] = f"{platform.machine()}, torch {torch.__version__}, 2 threads"
    (OUT / "targets.md").write_text(report(results))
    print(report(results))


def report(r: dict) -> str:
    def row(name: str, x: dict) -> str:
        t = next(iter(x["targets"].values()))
        when = f"step {t['step']}, {t['seconds']:.1f} s" if t["step"] is not None else "-"
        return (
            f"| {name} | {x['stopped_by']} | {t['status']} | {t['value']:.4g} | {when} | "
            f"{x['checkpoint_step']} | {x['held_out_loss']:.4f} |"
        )

    t = r["target_loss"]
    return "\n".join(
        [
            "# Targets and limits on the default recipe",
            "",
            f"`python bench/targets.py` ({r['machine']}): `gradaccum train` as a user runs it "
            "(the default recipe, planned for 512MB, 150 steps at most).",
            "",
            "| command | stopped by | status | observed | when | checkpoint at step | "
            "held-out loss |",
            "|---|---|---|---:|---|---:|---:|",
            row("`--target-loss 2.7 --eval-every 10`", t),
            row("`--max-time 20s`", r["max_time"]),
            row("then `--resume RUN --max-time 40s`", r["max_time_resumed"]),
            "",
            "Held-out loss at each evaluation of the target run: "
            + ", ".join(f"step {s}: {v}" for s, v in t["evaluations"])
            + f". Its log: `{t['log'][0] if t['log'] else ''}`. The resumed run's time counts "
            "the first session's, so it trains about 20 s more.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
