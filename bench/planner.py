"""The plan against the whole run it plans: predicted and measured peak, phase by phase.

For every built-in recipe at its default budget, and for a tiny GPT-2 and a tiny Llama-like
model of Hugging Face's (made here, with a BPE tokenizer trained on a stdlib file), fully
fine-tuned and with LoRA (merged at the end), on a --data file of prompt/completion pairs of
varying lengths, each at two budgets: `gradaccum train` as a user runs it (a fresh process,
2 threads), short but with every phase (windows, held-out evaluations, checkpoints, the
exports), the plan cache off. Its plan.json holds what the plan predicted for each phase; its
memory.json what each phase peaked at in the run, by the same meter (CPU: the parameters'
bytes plus the resident set's rise above the moment before the first step). Then the same
command again with the plan cache on: the setup's seconds (start to the first step) with the
plan measured and with the cached one.

Writes bench/results/planner.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gradaccum.memory import format_bytes, parse_bytes

OUT = Path(__file__).parent / "results"
PHASES = ("training", "evaluation", "checkpoint", "export")
SHORT = ["--eval-every", "2", "--checkpoint-every", "2", "--no-noise-scale"]


def tiny_models(folder: Path) -> dict[str, Path]:
    """A GPT-2 and a Llama-like model (4 layers, width 128, a 2,000-token BPE vocabulary),
    each saved with the tokenizer beside it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([open(json.__file__).read() + open(os.__file__).read()], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    eos = fast.eos_token_id
    configs = {
        "gpt2": transformers.GPT2Config(
            vocab_size=len(fast), n_positions=128, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=eos, eos_token_id=eos,
        ),
        "llama": transformers.LlamaConfig(
            vocab_size=len(fast), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        ),
    }  # fmt: skip
    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        path = folder / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        fast.save_pretrained(path)
        out[name] = path
    return out


def pairs_file(folder: Path) -> Path:
    """400 prompt/completion pairs from the stdlib's functions, 1 to ~40 lines each."""
    import argparse
    import inspect
    import shutil
    import subprocess
    import textwrap
    import typing

    rows = []
    for module in (json, os, textwrap, inspect, argparse, shutil, subprocess, typing):
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            head, _, body = source.partition("\n")
            rows.append({"prompt": head[:60], "completion": body[: 35 * (1 + len(rows) % 6)]})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:400]))
    return path


def run(args: list[str], env: dict[str, str], out: Path) -> dict:
    """`gradaccum train ARGS --out OUT`: its plan, its phases' peaks, and the seconds from
    its start to its first step."""
    cmd = [sys.executable, "-m", "gradaccum", "train", *args, "--out", str(out)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    setup, lines, read = None, [], None
    for line in proc.stdout:
        lines.append(line)
        if setup is None and line.startswith("step "):
            setup = time.perf_counter() - started
        found = re.search(r"the plan is the cached one .*read in ([\d.]+) s", line)
        if found is not None:
            read = float(found.group(1))
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(lines[-30:])}")
    plan = json.loads((out / "plan.json").read_text())
    memory = json.loads((out / "memory.json").read_text())
    return {"plan": plan, "memory": memory, "setup": setup, "read": read}


def predicted(plan: dict) -> dict[str, float]:
    out = {"training": plan["predicted_peak"]}
    out.update({p["name"]: p["peak_bytes"] for p in plan.get("phases", ())})
    return out


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "GRADACCUM_PLAN_CACHE": "off"}
    work = Path(tempfile.mkdtemp(prefix="gradaccum-planner-"))
    models, data = tiny_models(work), pairs_file(work)
    hf = ["--data", str(data), "--seq-len", "128", "--effective-batch", "64", "--steps", "4"]
    cases = [
        ("gpt", ["--steps", "4"], None),
        ("digits", ["--recipe", "digits", "--steps", "4"], None),
        ("segment", ["--recipe", "segment", "--steps", "4"], None),
        ("minilm", ["--recipe", "minilm", "--steps", "4"], None),
    ]
    for name, path in models.items():
        for budget in ("120MB", "300MB"):
            cases.append((f"{name} full", ["--hf-model", str(path), *hf], budget))
        for budget in ("100MB", "250MB"):
            lora = ["--lora", "8", "--merge-lora", "--lr", "1e-3"]
            cases.append((f"{name} LoRA", ["--hf-model", str(path), *hf, *lora], budget))
    rows = []
    for name, args, budget in cases:
        full = [*args, *SHORT, *(["--budget", budget] if budget else [])]
        print(f"{name} {budget or 'default budget'}", flush=True)
        # the first run plans (and stores its plan), the second starts from the stored plan,
        # as a rerun or a resume does: a process that has run no probe
        cache = {**env, "GRADACCUM_PLAN_CACHE": str(work / f"plans-{len(rows)}")}
        first = run(full, cache, work / f"run-{len(rows)}")
        again = run(full, cache, work / f"rerun-{len(rows)}")
        plan = first["plan"]
        pred = predicted(plan)
        row = {
            "case": name,
            "budget": plan["budget"],
            "micro": plan["micro_size"],
            "eval_micro": next(
                (p["micro_size"] for p in plan.get("phases", ()) if p["name"] == "evaluation"),
                plan["micro_size"],
            ),
            "predicted": pred,
            "whole_predicted": max(pred.values()),
            "runs": [first["memory"], again["memory"]],
            "plan_seconds": plan["seconds"],
            "setup": (first["setup"], again["setup"]),
            "read": again["read"],
        }
        rows.append(row)
        print(
            f"  micro {plan['micro_size']}, predicted {format_bytes(row['whole_predicted'])}, "
            f"measured {format_bytes(first['memory']['peak'])} (planning run) and "
            f"{format_bytes(again['memory']['peak'])} (rerun) of {format_bytes(plan['budget'])}; "
            f"planned in {plan['seconds']:.1f} s; setup {first['setup']:.1f} s, cached "
            f"{again['setup']:.1f} s",
            flush=True,
        )
    write(rows)


NOTES = [
    "## Reading it",
    "",
    "- *Planning run* against *rerun*: the planning process runs the probes before it "
    "trains, so the one-time allocations of a first step (thread pools, kernels' caches) "
    "are below its meter's baseline by its first window and it measures less; a rerun or a "
    "resume starts from the stored plan in a fresh process, as the plan's verification "
    "does, and pays them inside its first window. A stored plan serves both, so it is "
    "made for the rerun's case.",
    "- digits: its run is a few MiB of tensors beside the first step's one-time "
    "allocations of a fresh process, a peak a few percent of its budget: the percentages "
    "are of a small number.",
    "- Every prediction is the fresh process's miniature run (windows, an evaluation, a "
    "checkpoint, windows again) at the planned size; on CPU the resident set of the same "
    "training differs by several percent from one process to the next (glibc's heap "
    "layout), which the 15% margin keeps free.",
]


def write(rows: list[dict]) -> None:
    def mib(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f}"

    def err(predicted: float, measured: float) -> str:
        return f"{(predicted - measured) / measured:+.1%}"

    lines = [
        "# The plan against the whole run",
        "",
        f"`python bench/planner.py` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, 2 threads per run. Each case is "
        "`gradaccum train` as a user runs it, 4 optimizer steps with a held-out evaluation "
        "and a checkpoint every 2 and the exports at the end (a Hugging Face model's; a LoRA "
        "run's adapter and merged model), run twice: the first plans (and stores the plan), "
        "the second starts from the stored plan, as a rerun or a resume does. Meter: the "
        "parameters' and buffers' bytes plus the resident set's rise above the moment before "
        "the first step, in the plan as in the run (`TrainingMemory`). *Predicted*: the "
        "plan's measurement of each part (plan.json; training includes the window's input "
        "batch); *measured*: the run's peak in that part (memory.json). Error: (predicted - "
        "measured) / measured.",
        "",
        "## The whole run's peak",
        "",
        "| case | budget | micro-batch (evaluation's) | predicted | planning run | error | "
        "rerun | error | largest / budget |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = (m["peak"] for m in r["runs"])
        lines.append(
            f"| {r['case']} | {format_bytes(r['budget'])} | {r['micro']} ({r['eval_micro']}) | "
            f"{format_bytes(r['whole_predicted'])} | {format_bytes(a)} | "
            f"{err(r['whole_predicted'], a)} | {format_bytes(b)} | "
            f"{err(r['whole_predicted'], b)} | {max(a, b) / r['budget']:.0%} |"
        )
    errors = [abs(r["whole_predicted"] - m["peak"]) / m["peak"] for r in rows for m in r["runs"]]
    within = sum(e <= 0.10 for e in errors)
    over = [r["case"] for r in rows if any(m["peak"] > r["budget"] for m in r["runs"])]
    lines += [
        "",
        f"Within 10% of the measured peak: {within} of {len(errors)} runs; worst "
        f"{max(errors):.1%}. Runs above their budget: {', '.join(over) if over else 'none'}.",
        "",
        "## Phase by phase (MiB: predicted / planning run / rerun)",
        "",
        "| case | budget | " + " | ".join(PHASES) + " |",
        "|---|---:|" + "---:|" * len(PHASES),
    ]
    for r in rows:
        cells = []
        for p in PHASES:
            got = [m["phases"].get(p) for m in r["runs"]]
            if p not in r["predicted"] and not any(got):
                cells.append("")
                continue
            cells.append(" / ".join(mib(x) for x in (r["predicted"].get(p), *got)))
        lines.append(f"| {r['case']} | {format_bytes(r['budget'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Planning time, and the rerun from the plan cache",
        "",
        "The plan's own seconds (probes, the fresh-process verification, the phases), and the "
        "seconds from the command's start to its first step: planning, and with the stored plan.",
        "",
        "| case | planning (plan.json) | start to first step | with the cached plan | the "
        "cached plan read in |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["setup"]
        read = "-" if r["read"] is None else f"{r['read']:.2f} s"
        lines.append(
            f"| {r['case']} | {r['plan_seconds']:.1f} s | {a:.1f} s | {b:.1f} s | {read} |"
        )
    lines += ["", *NOTES]
    OUT.mkdir(exist_ok=True)
    (OUT / "planner.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    assert parse_bytes("1MB") == 10**6
    main()
