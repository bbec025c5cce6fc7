r"""Five peer GPU-memory estimators asked for the same fine-tuning run, so that
bench/published.py can put their numbers beside ours on the published rows.

    from peer_estimators import PEERS, ask
    ask(case) -> {peer: {"bytes": int, "said": str} | {"why": str}}

``case`` holds "config" (a Hugging Face config.json dict), "params" (the total parameter
count, computed by the caller), "seq_len", "micro_batch", "grad_accum", "precision" ("bf16",
"fp16", "fp32"), "optimizer" ("adamw", "adafactor", "adamw8bit"), "lora" (None or {"r",
"alpha", "target_modules", "modules_to_save"}), "quantization" (None or "nf4"),
"checkpointing" (bool), "gpu" (e.g. "a100-80gb", "v100"), "task" ("causal-lm" or
"sequence-classification"), and optionally "attention" ("eager", "sdpa",
"flash_attention_2"; absent: each peer's own default, said in "said").

This module is standard library only. Each peer runs in its own interpreter,
``.venv-peers/bin/python`` beside the project's ``.venv`` (never installed into ``.venv``),
one small Python snippet per peer, the case's translation in on stdin, one JSON line out,
60 s timeout, OMP_NUM_THREADS=1, Hugging Face hub offline (no peer is given a model id:
every one gets the shapes and the parameter count, so none downloads anything). The five
run at once, in five processes.

"bytes" is the peer's own total converted to bytes (every one of the five computes its
"GB" as bytes / 1024**3, i.e. GiB; fitcheck works in MiB); "said" gives the number as the
peer returned it, its unit, its parts, and what of the case the peer could not take.
"why" (one line) replaces the number when the peer's answer would be about another run:
a LoRA run asked of a peer that only models full fine-tuning, or a full fine-tuning run
whose optimizer the peer does not model (it would silently bill Adam's states). For a LoRA
run an optimizer the peer does not model is billed as AdamW and said (adapter states are
a small part). Nothing here adds, scales or corrects a peer's number.

The peers (PyPI names and the versions these translations were written against; the
snippet refuses a different installed version):

fitcheck-llm 0.3.1 (module ``fitcheck``), "estimate LLM training and serving memory from
    model configs". Called as ``fitcheck.estimate(ModelConfig, TrainingConfig, GpuSpec)``;
    the ModelConfig is built by fitcheck's own config.json parser (``_parse_fields``, and
    its MoE/multimodal refusal ``_reject_unsupported``) on the case's config dict, with the
    case's parameter count in place of its Hub lookup (``fetch_model_config`` downloads
    config.json and the Hub's count; that is the only online part). Models: training of a
    dense decoder LM with a 3-matrix (SwiGLU) MLP -- weights (nf4 with block scales), LoRA
    adapters (fp32) on q/k/v/o/gate/up/down_proj, gradients, AdamW fp32 / 8-bit states
    (fp32 master copy for 16-bit full fine-tuning), activations per layer with eager
    attention scores or flash attention, vocab-size logits (3.5 fp32 copies),
    checkpointing (stored layer inputs plus the larger of one layer or the logits), CUDA
    context and a fragmentation share (measured only on a T4; elsewhere its default 500
    MiB + 5%). Returns ``total_mib`` (MiB). Leaves out: Adafactor (not in its table),
    modules_to_save, encoder models and classification heads (a BERT is billed as a
    decoder LM with vocab-size logits), biases in its own count (the case's count is used).
ftuneai 0.4.1 (module ``ftuneai``; its ``__version__`` says 0.2.0), "estimate GPU memory,
    training time and costs for LLM fine-tuning". Called as
    ``ftuneai.core.memory.MemoryEstimator(ModelSpec, TrainingConfig).estimate()`` with a
    ModelSpec built from the config (its ``Estimator(model=...)`` front door looks the name
    up in its YAML list or on the Hub). Models: weights at the model dtype (int4/int8 +
    1-2%), LoRA adapters for three target presets (q,v / q,k,v,o / all linear) at 2 B,
    gradients at 2 B, optimizer states (AdamW 8 B, Adafactor 4 B, 8-bit Adam 2 B per
    trainable parameter), activations B*S*H*L*2 B * (4 with checkpointing, 10 without)
    halved for flash attention and doubled for QLoRA, then +20% overhead. Returns
    ``total_gb`` = bytes / 1024**3 rounded to 0.001 (GiB). Leaves out: fp32 gradients and
    activations (always 2 B), master weights, logits, the exact target module list (the
    smallest preset covering it is used), modules_to_save; nf4 is its "4bit".
alloc 0.0.16 (module ``alloc``), "engineer-first training calibration". Called as
    ``alloc.ghost(param_count=, dtype=, batch_size=, seq_length=, hidden_dim=,
    optimizer_type=)`` (its "Ghost Scan" without a model object). Models: full
    fine-tuning only -- weights at dtype, gradients (4 B under 16-bit), optimizer states by
    class name (AdamW 12 B incl. a master copy, also in fp32; Adafactor 4 B; AdamW8bit 6 B),
    activations B*S*H*bytes per layer with layers guessed as params / (12 H^2), +10%
    buffer. Returns ``total_gb`` = bytes / 1024**3 rounded to 0.01 (GiB). Leaves out: LoRA
    (so LoRA runs are "why"), quantization, checkpointing, attention scores and logits.
gpu-estimator 0.2.0 (module ``gpu_estimator``; its ``__version__`` says 0.1.4), "estimate
    GPU memory requirements and the number of GPUs needed for training". Called as
    ``GPUEstimator().estimate(model_params=, batch_size=, sequence_length=, precision=,
    optimizer=, gpu_memory_gb= | gpu_type=, gradient_checkpointing=)``. Models: full
    fine-tuning only -- weights and gradients at the precision, Adam/AdamW states (2x the
    weights in fp32, 4x in 16-bit), SGD, activations B*S*sqrt(params)*bytes (x0.3 with
    checkpointing), then x1.2. Returns ``total_memory_gb`` = bytes / 1024**3 (GiB), the
    one-GPU total (its num_gpus and per-GPU split are said, not used). Leaves out: LoRA and
    quantization ("why"), Adafactor and 8-bit AdamW (it bills Adam's states: "why" for
    full fine-tuning), attention, logits.
hf-vram-calc 1.0.9 (module ``hf_vram_calc``), "GPU memory calculator for Hugging Face models
    with different data types". Called as ``LlmodelMemoryResult(dtype, batch_size,
    sequence_length, lora_rank).calculate_all(ModelConfig, num_params,
    VRAMCalculator(ConfigManager()))`` with the case's parameter count (its CLI counts
    parameters by building the model on the meta device from a downloaded config.json).
    Reads ``training_memory`` ("Training (Adam) (GiB)" = weights x 4 x 1.3) for full
    fine-tuning and ``lora_memory`` ("LoRA (GiB)" = (weights + rank-based adapter
    estimate x 2 B x 4) x 1.2) for LoRA; GiB. Leaves out: activations, batch, sequence
    length and checkpointing (none enter either number), the optimizer (Adam assumed),
    the target modules (it assumes 25% of parameters targeted, width 4096),
    modules_to_save; nf4 is its "int4" (0.5 B).

Set up ``.venv-peers`` (from the repository root; the torch wheel is the CPU build this
machine's pip finds in its local wheel folder -- any other torch version pulls a CUDA build):

    .venv/bin/python -m venv .venv-peers
    .venv-peers/bin/pip install --no-deps alloc==0.0.16 fitcheck-llm==0.3.1 \
        ftuneai==0.4.1 gpu-estimator==0.2.0 hf-vram-calc==1.0.9
    .venv-peers/bin/pip install torch==2.13.0 transformers==5.25.0 accelerate==1.16.0 \
        pyyaml huggingface_hub requests

(The first run of this used the same five wheels downloaded to /tmp/peers:
``.venv-peers/bin/pip install --no-deps /tmp/peers/*.whl``.) Why each: fitcheck imports
huggingface_hub at module level; ftuneai imports yaml; hf_vram_calc imports torch,
accelerate, transformers (at module level, for its parameter counting, unused here) and
requests; gpu_estimator and alloc import nothing beyond that (alloc's declared typer, rich,
httpx, pydantic, pyyaml, pynvml are for its CLI and GPU probe; ``pip check`` still names
httpx and pynvml as missing, harmlessly). ``.venv-peers`` is not in .gitignore: keep it out
of commits.

    python bench/peer_estimators.py     # asks the two check cases below and prints them
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = HERE.parent / ".venv-peers" / "bin" / "python"
TIMEOUT_S = 60
MiB, GiB = 1 << 20, 1 << 30

PEERS = ("fitcheck-llm", "ftuneai", "alloc", "gpu-estimator", "hf-vram-calc")
VERSIONS = {
    "fitcheck-llm": "0.3.1",
    "ftuneai": "0.4.1",
    "alloc": "0.0.16",
    "gpu-estimator": "0.2.0",
    "hf-vram-calc": "1.0.9",
}

# Each snippet reads {"dist", "version", ...its arguments} on stdin and prints one line
# MARK + JSON: the peer's raw result, or {"why": ...} when the peer itself refused the input.
MARK = "@@peer-result@@"
PRELUDE = f"""
import json, sys
from importlib.metadata import version
a = json.load(sys.stdin)
def out(d):
    print("\\n{MARK}" + json.dumps(d), flush=True)
_v = version(a["dist"])
if _v != a["version"]:
    out({{"why": f"installed {{a['dist']}} {{_v}}, translated for {{a['version']}}: "
                 "rebuild .venv-peers"}})
    sys.exit(0)
"""

SNIPPETS = {
    "fitcheck-llm": """
import dataclasses
from fitcheck import TrainingConfig, estimate, get_gpu
from fitcheck.config_parser import ModelConfig, _parse_fields, _reject_unsupported
try:
    _reject_unsupported(a["config"], a["name"])
    fields = dataclasses.asdict(_parse_fields(a["config"]))
    model = ModelConfig(name=a["name"], num_params=a["params"], **fields)
    gpu = get_gpu(a["gpu"]) if a["gpu"] else get_gpu(a["gpu_name"], vram_mib=a["vram_mib"])
    r = estimate(model, TrainingConfig(**a["training"]), gpu)
except ValueError as e:  # fitcheck's own refusals (UnsupportedModelError is one)
    out({"why": "fitcheck refused: " + str(e).splitlines()[0][:200]})
    sys.exit(0)
out({k: getattr(r, k) for k in ("weight_mib", "lora_mib", "optimizer_mib", "gradient_mib",
                                "activation_mib", "overhead_mib", "total_mib")})
""",
    "ftuneai": """
import dataclasses
from ftuneai.core.memory import MemoryEstimator
from ftuneai.core.models import (FineTuneMethod, LoRATarget, ModelSpec, OptimizerType,
                                 Quantization, TrainingConfig)
t = a["training"]
try:
    config = TrainingConfig(
        model=a["model"]["name"], method=FineTuneMethod(t["method"]),
        quantization=Quantization(t["quantization"]), batch_size=t["batch_size"],
        seq_length=t["seq_length"], gradient_checkpointing=t["gradient_checkpointing"],
        optimizer=OptimizerType(t["optimizer"]), lora_rank=t["lora_rank"],
        lora_alpha=t["lora_alpha"], lora_target=LoRATarget(t["lora_target"]),
        flash_attention=t["flash_attention"])
    r = MemoryEstimator(ModelSpec(**a["model"]), config).estimate()
except ValueError as e:
    out({"why": "ftuneai refused: " + str(e).splitlines()[0][:200]})
    sys.exit(0)
out(dataclasses.asdict(r))
""",
    "alloc": """
import alloc
r = alloc.ghost(**a["kwargs"])
out(r.to_dict())
""",
    "gpu-estimator": """
from gpu_estimator.estimator import GPUEstimator
out(GPUEstimator().estimate(**a["kwargs"]).to_dict())
""",
    "hf-vram-calc": """
from hf_vram_calc.calculator import LlmodelMemoryResult, VRAMCalculator
from hf_vram_calc.config import ConfigManager
from hf_vram_calc.models import ModelConfig
r = LlmodelMemoryResult(**a["result"])
r.calculate_all(ModelConfig(**a["model"]), a["params"], VRAMCalculator(ConfigManager()))
out({k: getattr(r, k) for k in ("dtype", "base_memory", "training_memory", "lora_memory",
                                "activation_memory", "kv_cache_memory")})
""",
}


# ---------------------------------------------------------------- reading the case


def _heads(config: dict) -> tuple[int, int]:
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads


def _name(case: dict) -> str:
    c = case["config"]
    return f"{c.get('model_type', 'model')}-{case['params']}"


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# BERT's attention projections by the Llama names both peers below know
TARGET_ALIASES = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}


def _targets(lora: dict) -> tuple[list[str], list[str]]:
    """(the case's LoRA targets in q_proj..down_proj names, those with no such name)."""
    raw = lora.get("target_modules") or []
    if isinstance(raw, str):
        raw = list(LLAMA_TARGETS) if raw == "all-linear" else [raw]
    known, unknown = [], []
    for t in raw:
        t = TARGET_ALIASES.get(t.split(".")[-1], t.split(".")[-1])
        if t in LLAMA_TARGETS:
            if t not in known:
                known.append(t)
        else:
            unknown.append(t)
    return known, unknown


def _gpu(case: dict) -> tuple[str, int | None]:
    """('a100', 80) from 'a100-80gb', ('v100', None) from 'v100'."""
    g = str(case.get("gpu") or "").lower().replace("nvidia", "").strip().replace(" ", "-")
    m = re.search(r"[-_](\d+)g(?:i?b)?$", g)
    mem = int(m.group(1)) if m else None
    family = g[: m.start()] if m else g
    return family.replace("rtx", "").replace("tesla", "").strip("-_"), mem


def _flash(case: dict) -> bool | None:
    """True for a kernel that holds no S x S score matrix; None when the case does not say."""
    att = case.get("attention")
    if att is None:
        return None
    return str(att).lower() in ("flash", "flash_attention_2", "flash_attention_3", "sdpa")


def _lora_modules_to_save(case: dict) -> str | None:
    lora = case.get("lora")
    if lora and lora.get("modules_to_save"):
        return "modules_to_save " + ",".join(lora["modules_to_save"])
    return None


def _full_ft_optimizer_why(case: dict, peer: str, known: tuple[str, ...]) -> str | None:
    if case.get("lora") is None and case["optimizer"] not in known:
        return (
            f"{peer} does not model {case['optimizer']} (it would bill "
            f"{'AdamW' if peer != 'gpu-estimator' else 'Adam'}'s states), and in full "
            "fine-tuning the optimizer states are a large part of the total"
        )
    return None


# ---------------------------------------------------------------- per-peer translations
# Each returns (the snippet's arguments, notes for "said") or a "why" string.

FITCHECK_GPUS = {
    ("a100", 80): "a100-80",
    ("a100", 40): "a100-40",
    ("h100", None): "h100",
    ("h100", 80): "h100",
    ("h200", None): "h200",
    ("h200", 141): "h200",
    ("b200", None): "b200",
    ("v100", None): "v100-16",
    ("v100", 16): "v100-16",
    ("t4", None): "t4",
    ("t4", 16): "t4",
    ("p100", None): "p100-16",
    ("p100", 16): "p100-16",
    ("l4", None): "l4",
    ("l4", 24): "l4",
    ("a10", None): "a10",
    ("a10", 24): "a10",
    ("a10g", None): "a10",
    ("a10g", 24): "a10",
    ("a6000", None): "a6000",
    ("a6000", 48): "a6000",
    ("l40", None): "l40",
    ("l40s", None): "l40s",
    ("3090", None): "3090",
    ("3090", 24): "3090",
    ("4090", None): "4090",
    ("4090", 24): "4090",
    ("5090", None): "5090",
}


def _plan_fitcheck(case: dict):
    notes = []
    lora = case.get("lora")
    optimizer = case["optimizer"]
    if why := _full_ft_optimizer_why(case, "fitcheck-llm", ("adamw", "adamw8bit")):
        return why
    if optimizer not in ("adamw", "adamw8bit"):
        notes.append(f"{optimizer} billed as adamw (not in its table)")
        optimizer = "adamw"
    targets = None
    if lora:
        targets, unknown = _targets(lora)
        if not targets:
            return (
                f"fitcheck-llm's LoRA targets are q/k/v/o/gate/up/down_proj only; "
                f"the case targets {lora.get('target_modules')}"
            )
        if unknown:
            notes.append("targets " + ",".join(unknown) + " left out (not in its list)")
    flash = _flash(case)
    if flash is None:
        notes.append("attention not given: eager (its default)")
    family, mem = _gpu(case)
    key = FITCHECK_GPUS.get((family, mem)) or FITCHECK_GPUS.get((family, None))
    if key is None:
        notes.append(f"gpu {case.get('gpu')!r} not in its table: default overhead profile")
    if m := _lora_modules_to_save(case):
        notes.append(m + " left out")
    if case.get("task") == "sequence-classification":
        notes.append("modelled as a decoder LM (vocab-size logits, 3-matrix MLP), not a classifier")
    return {
        "name": _name(case),
        "config": case["config"],
        "params": case["params"],
        "gpu": key,
        "gpu_name": str(case.get("gpu") or "gpu"),
        "vram_mib": (mem or 80) * 1024,
        "training": {
            "precision": case["precision"],
            "quantization": case.get("quantization") or "none",
            "optimizer": optimizer,
            "batch_size": case["micro_batch"],
            "seq_len": case["seq_len"],
            "lora_rank": lora["r"] if lora else None,
            "lora_targets": targets or ["q_proj", "k_proj", "v_proj", "o_proj"],
            "grad_checkpoint": bool(case["checkpointing"]),
            "flash_attn": bool(flash),
            "grad_accum_steps": case["grad_accum"],
        },
    }, notes


def _said_fitcheck(r: dict) -> tuple[int, str]:
    parts = ("weight", "lora", "optimizer", "gradient", "activation", "overhead")
    s = ", ".join(f"{p} {r[p + '_mib']:.0f}" for p in parts)
    return round(r["total_mib"] * MiB), f"total_mib={r['total_mib']:.1f} MiB ({s} MiB)"


FTUNE_PRESETS = (  # smallest first
    ("attention", ("q_proj", "v_proj")),
    ("attention_all", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("all_linear", LLAMA_TARGETS),
)
FTUNE_OPTIMIZERS = {"adamw": "adamw", "adafactor": "adafactor", "adamw8bit": "adam_8bit"}
FTUNE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _plan_ftuneai(case: dict):
    notes = []
    c = case["config"]
    lora = case.get("lora")
    quant = case.get("quantization")
    if quant and not lora:
        return "ftuneai does not model full fine-tuning of a quantized model"
    if quant not in (None, "nf4"):
        return f"ftuneai has no {quant} quantization"
    target = "attention"
    if lora:
        targets, unknown = _targets(lora)
        if not targets:
            return (
                f"ftuneai's LoRA presets cover q/k/v/o/gate/up/down_proj only; "
                f"the case targets {lora.get('target_modules')}"
            )
        target, covered = next((n, t) for n, t in FTUNE_PRESETS if set(targets) <= set(t))
        if set(covered) != set(targets):
            notes.append(f"targets billed as its preset {target} ({','.join(covered)})")
        if unknown:
            notes.append("targets " + ",".join(unknown) + " left out")
    heads, kv = _heads(c)
    max_len = c.get("max_position_embeddings")
    if max_len is None:
        max_len = case["seq_len"]
        notes.append("no max_position_embeddings: seq_len used as its max")
    flash = _flash(case)
    if flash is None:
        notes.append("attention not given: no flash (its default)")
    if quant:
        notes.append("nf4 as its 4bit (0.5 B + 2%)")
    if case["precision"] == "fp32":
        notes.append("gradients and activations billed at 2 B (its fixed bf16)")
    if m := _lora_modules_to_save(case):
        notes.append(m + " left out")
    return {
        "model": {
            "name": _name(case),
            "parameters": case["params"],
            "hidden_size": c["hidden_size"],
            "num_layers": c["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_kv_heads": kv,
            "intermediate_size": c.get("intermediate_size") or 4 * c["hidden_size"],
            "vocab_size": c["vocab_size"],
            "max_seq_length": max_len,
            "default_dtype": FTUNE_DTYPES[case["precision"]],
        },
        "training": {
            "method": ("qlora" if quant else "lora") if lora else "full",
            "quantization": "4bit" if quant else "none",
            "batch_size": case["micro_batch"],
            "seq_length": case["seq_len"],
            "gradient_checkpointing": bool(case["checkpointing"]),
            "optimizer": FTUNE_OPTIMIZERS[case["optimizer"]],
            "lora_rank": lora["r"] if lora else 16,
            "lora_alpha": lora.get("alpha", 32) if lora else 32,
            "lora_target": target,
            "flash_attention": bool(flash),
        },
    }, notes


def _said_ftuneai(r: dict) -> tuple[int, str]:
    parts = (
        "model_weights",
        "trainable_params",
        "gradients",
        "optimizer_states",
        "activations",
        "overhead",
    )
    s = ", ".join(f"{p.split('_')[0]} {r[p + '_gb']:.3f}" for p in parts)
    return (
        round(r["total_gb"] * GiB),
        f"total_gb={r['total_gb']} (its 'GB' = bytes/1024**3, GiB; {s})",
    )


ALLOC_OPTIMIZERS = {"adamw": "AdamW", "adafactor": "Adafactor", "adamw8bit": "AdamW8bit"}


def _plan_alloc(case: dict):
    if case.get("lora"):
        return (
            "alloc's ghost scan models full fine-tuning only (gradients and optimizer "
            "states for every parameter); it has no LoRA input"
        )
    if case.get("quantization"):
        return "alloc's ghost scan has no quantized-base training"
    notes = []
    if case["checkpointing"]:
        notes.append("checkpointing left out (not modelled)")
    if case["optimizer"] == "adamw" and case["precision"] == "fp32":
        notes.append("AdamW billed at its 12 B/param (master copy) also in fp32")
    return {
        "kwargs": {
            "param_count": case["params"],
            "dtype": case["precision"],
            "batch_size": case["micro_batch"],
            "seq_length": case["seq_len"],
            "hidden_dim": case["config"]["hidden_size"],
            "optimizer_type": ALLOC_OPTIMIZERS[case["optimizer"]],
        }
    }, notes


def _said_alloc(r: dict) -> tuple[int, str] | str:
    if r.get("estimation_failed"):
        return "alloc's ghost scan reported estimation_failed"
    parts = ("weights", "gradients", "optimizer", "activations", "buffer")
    s = ", ".join(f"{p} {r[p + '_gb']}" for p in parts)
    return (
        round(r["total_gb"] * GiB),
        f"total_gb={r['total_gb']} (bytes/1024**3, GiB, 2 decimals; {s}; "
        f"{r['num_layers']} layers guessed)",
    )


GPU_ESTIMATOR_TYPES = {
    "v100": "V100",
    "a100": "A100",
    "h100": "H100",
    "b200": "B200",
    "3090": "RTX3090",
    "4090": "RTX4090",
    "t4": "T4",
    "l4": "L4",
    "l40": "L40",
    "a40": "A40",
    "a6000": "A6000",
}


def _plan_gpu_estimator(case: dict):
    if case.get("lora"):
        return (
            "gpu-estimator models full fine-tuning only (weights, gradients and Adam "
            "states for every parameter); it has no LoRA input"
        )
    if case.get("quantization"):
        return "gpu-estimator has no 4-bit weights"
    if why := _full_ft_optimizer_why(case, "gpu-estimator", ("adamw",)):
        return why
    kwargs = {
        "model_params": case["params"],
        "batch_size": case["micro_batch"],
        "sequence_length": case["seq_len"],
        "precision": case["precision"],
        "optimizer": "adamw",
        "gradient_checkpointing": bool(case["checkpointing"]),
    }
    family, mem = _gpu(case)
    if mem:
        kwargs["gpu_memory_gb"] = mem
    elif family in GPU_ESTIMATOR_TYPES:
        kwargs["gpu_type"] = GPU_ESTIMATOR_TYPES[family]
    return {"kwargs": kwargs}, []


def _said_gpu_estimator(r: dict) -> tuple[int, str]:
    parts = ("model", "gradient", "optimizer", "activation")
    s = ", ".join(f"{p} {r[p + '_memory_gb']:.3f}" for p in parts)
    return (
        round(r["total_memory_gb"] * GiB),
        f"total_memory_gb={r['total_memory_gb']:.3f} (bytes/1024**3, GiB; {s}; x1.2; "
        f"it would use {r['num_gpus']} GPU(s))",
    )


HF_VRAM_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _plan_hf_vram_calc(case: dict):
    lora = case.get("lora")
    quant = case.get("quantization")
    if quant and not lora:
        return "hf-vram-calc's training figure has no quantized base"
    if quant not in (None, "nf4"):
        return f"hf-vram-calc has no {quant}"
    if why := _full_ft_optimizer_why(case, "hf-vram-calc", ("adamw",)):
        return why
    c = case["config"]
    notes = ["activations, batch, seq_len and checkpointing do not enter its figure"]
    if lora:
        notes.append("target modules not an input (it assumes 25% of params, width 4096)")
        if case["optimizer"] != "adamw":
            notes.append(f"{case['optimizer']} billed as Adam")
    if quant:
        notes.append("nf4 as its int4 (0.5 B)")
    if m := _lora_modules_to_save(case):
        notes.append(m + " left out")
    return {
        "params": case["params"],
        "model": {
            "model_name": _name(case),
            "vocab_size": c["vocab_size"],
            "hidden_size": c["hidden_size"],
            "num_layers": c["num_hidden_layers"],
            "num_attention_heads": c["num_attention_heads"],
            "intermediate_size": c.get("intermediate_size"),
            "num_key_value_heads": c.get("num_key_value_heads"),
            "max_position_embeddings": c.get("max_position_embeddings"),
            "model_type": c.get("model_type", "unknown"),
        },
        "result": {
            "dtype": "int4" if quant else HF_VRAM_DTYPES[case["precision"]],
            "batch_size": case["micro_batch"],
            "sequence_length": case["seq_len"],
            "lora_rank": lora["r"] if lora else 64,
        },
        "lora": bool(lora),
    }, notes


def _said_hf_vram_calc(r: dict, lora: bool) -> tuple[int, str]:
    key, label = ("lora_memory", "LoRA") if lora else ("training_memory", "Training (Adam)")
    return (
        round(r[key] * GiB),
        f"{key}={r[key]:.3f} GiB (its '{label} (GiB)' column, {r['dtype']}; "
        f"weights {r['base_memory']:.3f} GiB)",
    )


PLANS = {
    "fitcheck-llm": _plan_fitcheck,
    "ftuneai": _plan_ftuneai,
    "alloc": _plan_alloc,
    "gpu-estimator": _plan_gpu_estimator,
    "hf-vram-calc": _plan_hf_vram_calc,
}


def _said(peer: str, args: dict, r: dict):
    if peer == "fitcheck-llm":
        return _said_fitcheck(r)
    if peer == "ftuneai":
        return _said_ftuneai(r)
    if peer == "alloc":
        return _said_alloc(r)
    if peer == "gpu-estimator":
        return _said_gpu_estimator(r)
    return _said_hf_vram_calc(r, args["lora"])


# ---------------------------------------------------------------- running


def _run(peer: str, args: dict) -> dict:
    """The peer's raw JSON result, or {"why": ...}."""
    if not PYTHON.exists():
        return {"why": f"{PYTHON} missing: set up .venv-peers (see this module's docstring)"}
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        TOKENIZERS_PARALLELISM="false",
    )
    payload = json.dumps({"dist": peer, "version": VERSIONS[peer], **args})
    with tempfile.TemporaryDirectory(prefix="peer-") as cwd:  # no peer reads or writes ours
        try:
            p = subprocess.run(
                [str(PYTHON), "-c", PRELUDE + SNIPPETS[peer]],
                input=payload,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                env=env,
                cwd=cwd,
            )
        except subprocess.TimeoutExpired:
            return {"why": f"{peer} did not answer within {TIMEOUT_S} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}, no output"])[-1]
    return {"why": f"{peer} failed: {tail[:200]}"}


def _ask_one(peer: str, case: dict) -> dict:
    plan = PLANS[peer](case)
    if isinstance(plan, str):
        return {"why": plan}
    args, notes = plan
    raw = _run(peer, args)
    if "why" in raw:
        return raw
    said = _said(peer, args, raw)
    if isinstance(said, str):
        return {"why": said}
    n, text = said
    if notes:
        text += "; " + "; ".join(notes)
    return {"bytes": int(n), "said": text}


def ask(case: dict) -> dict[str, dict]:
    """{peer: {"bytes": int, "said": "<what the peer returned, short>"} or
    {"why": "<one line: why this peer cannot express the case>"}}"""
    with ThreadPoolExecutor(max_workers=len(PEERS)) as pool:
        futures = {peer: pool.submit(_ask_one, peer, case) for peer in PEERS}
        return {peer: f.result() for peer, f in futures.items()}


# ---------------------------------------------------------------- the two check cases

CHECK_CASES = {
    "Qwen-7B-shaped LoRA r64, bf16, seq 2048, mb 1, checkpointing, A100-80GB": {
        "config": {
            "model_type": "qwen2",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "max_position_embeddings": 8192,
        },
        "params": 7721324544,
        "seq_len": 2048,
        "micro_batch": 1,
        "grad_accum": 8,
        "precision": "bf16",
        "optimizer": "adamw",
        "lora": {
            "r": 64,
            "alpha": 16,
            "target_modules": list(LLAMA_TARGETS),
            "modules_to_save": None,
        },
        "quantization": None,
        "checkpointing": True,
        "gpu": "a100-80gb",
        "task": "causal-lm",
    },
    "bert-large sequence classification, full fine-tuning fp32 AdamW, seq 512, mb 4, V100": {
        "config": {
            "model_type": "bert",
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "intermediate_size": 4096,
            "vocab_size": 30522,
            "max_position_embeddings": 512,
            "type_vocab_size": 2,
        },
        "params": 335143938,
        "seq_len": 512,
        "micro_batch": 4,
        "grad_accum": 1,
        "precision": "fp32",
        "optimizer": "adamw",
        "lora": None,
        "quantization": None,
        "checkpointing": False,
        "gpu": "v100",
        "task": "sequence-classification",
    },
}


def main() -> None:
    for title, case in CHECK_CASES.items():
        print(f"== {title}")
        for peer, got in ask(case).items():
            if "bytes" in got:
                print(
                    f"  {peer:14} {got['bytes']:>15,} B = {got['bytes'] / GiB:7.2f} GiB"
                    f"  | {got['said']}"
                )
            else:
                print(f"  {peer:14} why: {got['why']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
