"""How long the GPU question takes (issue 56): `gradaccum plan --device cuda` on a
Llama-3-8B-shaped config.json (written here: its published shape, no weights) for an RTX 4090,
as a new user asks it: LoRA r16 and QLoRA nf4 at 2048 tokens, effective batch 64, bf16, with
checkpointing and with "auto"; then the neighbouring questions (another budget, another
micro-batch, another sequence length, one of them refused), which reuse the cached traces.
Each command's wall time, from a private empty cache, with the machine's load before it.
Writes bench/results/estimate_speed.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import commit, describe

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 128256,
}  # fmt: skip
BASE = ["--gpu", "rtx4090", "--seq-len", "2048", "--effective-batch", "64", "--precision", "bf16"]
QUESTIONS = [
    ("LoRA r16, checkpointing on", ["--lora", "16", "--checkpointing", "on"]),
    ("  the same, --budget 40GB (neighbour)", ["--lora", "16", "--checkpointing", "on",
                                               "--budget", "40GB"]),
    ("  the same, --micro-batch 2 (neighbour)", ["--lora", "16", "--checkpointing", "on",
                                                 "--micro-batch", "2"]),
    ("  the same, --seq-len 1024 (neighbour)", ["--lora", "16", "--checkpointing", "on",
                                                "--seq-len", "1024"]),
    ("  the same, --seq-len 4096 (neighbour, refused)", ["--lora", "16", "--checkpointing",
                                                         "on", "--seq-len", "4096"]),
    ("LoRA r16, checkpointing auto", ["--lora", "16", "--checkpointing", "auto"]),
    ("QLoRA nf4 r16, checkpointing on", ["--lora", "16", "--quantize", "nf4",
                                         "--checkpointing", "on"]),
    ("QLoRA nf4 r16, checkpointing off", ["--lora", "16", "--quantize", "nf4"]),
    ("full fine-tuning (refused: what would fit)", []),
]  # fmt: skip
# asked first, each from its own empty cache: what the neighbours' answers must equal
FRESH = [
    ("--seq-len 1024 asked first (its own empty cache)", ["--lora", "16", "--checkpointing",
                                                          "on", "--seq-len", "1024"]),
]  # fmt: skip


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="estimate-speed-"))
    (tmp / "llama3-8b").mkdir()
    (tmp / "llama3-8b" / "config.json").write_text(json.dumps(LLAMA3_8B))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "GRADACCUM_PLAN_CACHE": str(tmp / "cache")}
    rows = []
    for index, (name, extra) in enumerate(QUESTIONS + FRESH):
        if index >= len(QUESTIONS):
            env["GRADACCUM_PLAN_CACHE"] = str(tmp / f"fresh{index}")
        cmd = [sys.executable, "-m", "gradaccum", "plan", "--device", "cuda", "--hf-model",
               str(tmp / "llama3-8b"), *BASE, *extra]  # fmt: skip
        load = os.getloadavg()[0]
        began = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - began
        first = next((line for line in done.stdout.splitlines() if line.startswith("ESTIMATE")), "")
        answer = first.split("): ", 1)[-1] if first else done.stderr.strip().splitlines()[-1]
        rows.append((name, took, load, done.returncode, answer))
        print(f"{name}: {took:.1f} s (load {load:.2f}, exit {done.returncode}): {answer}")
    lines = [
        "# How long the GPU question takes",
        "",
        f"`python bench/estimate_speed.py` at {commit()} on {describe(2)}: `gradaccum plan "
        "--device cuda --hf-model llama3-8b " + " ".join(BASE) + " ...`, each command's wall "
        "time from one private cache (empty at the first), in this order.",
        "",
        "| question | wall | load before | exit | answer |",
        "|---|---|---|---|---|",
        *(
            f"| {n} | {t:.1f} s | {ld:.2f} | {rc} | {a.replace('|', '/')} |"
            for n, t, ld, rc, a in rows
        ),  # fmt: skip
    ]
    out = Path(__file__).parent / "results" / "estimate_speed.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
