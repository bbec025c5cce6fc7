"""The estimate against published GPU measurements (issue 57), from bench/published/rows.jsonl
(each row a published number with its configuration and where it was published; how each was
pinned: bench/published/SOURCES.md).

Each pinned row that `gradaccum plan --device cuda` can express today is asked as a user would
ask it: a config.json written here from the model's published shape (no weights), the row's
sequence length, micro-batch and accumulation, precision, optimizer, LoRA adapter
(adapter_config.json), checkpointing, attention and GPU, each command a fresh process, one
private cache per model (a user asking about several lengths of one model). Every other row
is listed apart with what the estimate does not model for it. Writes
bench/results/published.md and bench/results/published.json.

    python bench/published.py [--only ID,ID,...] [--peers]

Beside each asked row, the five peer estimators (bench/peer_estimators.py: fitcheck-llm,
ftuneai, alloc, gpu-estimator, hf-vram-calc, from the package index, each in
.venv-peers, each given the same configuration as far as its own API takes it). ``--peers``
asks the peers alone, for the rows of the last run's published.json (our estimates kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import commit, describe

HERE = Path(__file__).parent
ROWS = HERE / "published" / "rows.jsonl"
GiB, GB, MiB = 1 << 30, 10**9, 1 << 20

# bert-large-uncased's published config (the transformers doc's runs; no weights needed)
BERT_LARGE = {
    "architectures": ["BertForSequenceClassification"], "model_type": "bert",
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "hidden_act": "gelu",
}  # fmt: skip
# The transformers doc's Trainer optimizers by our --optimizer names (bnb's Adam8bit holds
# AdamW8bit's state layout).
BERT_OPTIMIZERS = {
    "Trainer default": "adamw",
    "Adafactor": "adafactor",
    "bitsandbytes": "adamw8bit",
}


def qwen1(hidden: int, layers: int, heads: int, intermediate: int, vocab: int) -> dict:
    """A Qwen (1) model as transformers' Qwen2 holds the same shapes: its fused c_attn
    (with a bias) as q, k and v projections with biases, its MLP's w1 and w2 (each half the
    config's intermediate_size) as up and gate, c_proj as o_proj and down_proj; untied."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "intermediate_size": intermediate // 2,
        "vocab_size": vocab, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "hidden_act": "silu",
    }  # fmt: skip


QWEN = {
    "1.8B": qwen1(2048, 24, 16, 11008, 151936),
    "7B": qwen1(4096, 32, 32, 22016, 151936),
    "14B": qwen1(5120, 40, 40, 27392, 152064),
}
# litgpt's resource tables' models (tutorials/resource-tables.md) in transformers' classes of the
# same shapes: its GPT with a fused qkv is the same parameters as transformers' phi, GPT-NeoX
# (StableLM Alpha) and Llama with their own attention layouts; phi's GELU is litgpt's
# (torch's tanh approximation, one op: transformers' gelu_new is the same formula in six)
LITGPT = {
    "phi-1.5": ({
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
        "vocab_size": 51200, "max_position_embeddings": 2048, "partial_rotary_factor": 0.5,
        "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": False}, ["q_proj", "v_proj"]),
    "StableLM Alpha 3B": ({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 4096,
        "intermediate_size": 16384, "num_hidden_layers": 16, "num_attention_heads": 32,
        "vocab_size": 50688, "max_position_embeddings": 4096, "rotary_pct": 0.25,
        "use_parallel_residual": True, "tie_word_embeddings": False}, ["query_key_value"]),
    "Llama 2 7B": ({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}, ["q_proj", "v_proj"]),
    "Llama 2 13B": ({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 40, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}, ["q_proj", "v_proj"]),
}  # fmt: skip
# Qwen's finetune.py targets c_attn, c_proj, w1, w2: in Qwen2's names, every linear layer
QWEN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen's finetune/ds_config_zero2.json (at af22d5e), which its Q-LoRA script passes
QWEN_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                               "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
}  # fmt: skip


def express(row: dict) -> tuple[str, dict, list[str], str] | str:
    """(model key, config, the command's flags, what was assumed), or why the row is not
    asked."""
    repo = row["source"]["repo"]
    if not row["pinned"]:
        return "not pinned: " + (row.get("missing") or "configuration incomplete")[:160]
    if repo == "huggingface/transformers":
        precision = "fp16" if row["precision"].startswith("fp16") else "fp32"
        optimizer = next(v for k, v in BERT_OPTIMIZERS.items() if row["optimizer"].startswith(k))
        flags = ["--task", "sequence-classification", "--seq-len", "512",
                 "--micro-batch", str(row["micro_batch"]),
                 "--effective-batch", str(row["micro_batch"] * row["grad_accum"]),
                 "--precision", precision, "--optimizer", optimizer, "--gpu", "v100",
                 "--checkpointing", "on" if row["gradient_checkpointing"] else "off",
                 "--attn-implementation", "eager"]  # fmt: skip
        # eager: BERT's only attention in 2022's transformers
        return "bert-large", BERT_LARGE, flags, "Trainer's AdamW as torch's foreach AdamW"
    if repo == "QwenLM/Qwen":
        if row["method"] not in ("lora", "lora+emb", "qlora"):
            return f"not modelled: {row['framework']}"
        if row["params"] not in QWEN:
            return f"no config here for Qwen-{row['params']}"
        if row["method"] == "qlora":  # finetune_qlora_single_gpu.sh: fp16, ds_config_zero2.json
            config = {
                **QWEN[row["params"]],
                "quantization_config": {
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": 128,
                    "desc_act": False,
                },
            }
            adapter = {
                "peft_type": "LORA",
                "r": 64,
                "lora_alpha": 16,
                "lora_dropout": 0.05,
                "target_modules": QWEN_TARGETS,
                "bias": "none",
                "modules_to_save": None,
            }
            flags = ["--seq-len", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]),
                     "--effective-batch", str(row["micro_batch"] * row["grad_accum"]),
                     "--precision", "fp16", "--checkpointing", "on", "--gpu", "a100-80gb",
                     "--attn-implementation", "flash_attention_2", "--lora", adapter,
                     "--deepspeed", QWEN_ZERO2]  # fmt: skip
            key = f"qwen-{row['params']}-qlora"
            return key, config, flags, "Qwen-*-Chat-Int4's GPTQ layout; ZeRO-2 as Qwen's file"
        adapter = {"peft_type": "LORA", "r": 64, "lora_alpha": 16, "lora_dropout": 0.05,
                   "target_modules": QWEN_TARGETS, "bias": "none",
                   "modules_to_save": ["embed_tokens", "lm_head"]
                   if row["method"] == "lora+emb" else None}  # fmt: skip
        flags = ["--seq-len", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]),
                 "--effective-batch", str(row["micro_batch"] * row["grad_accum"]),
                 "--precision", "bf16", "--checkpointing", "on", "--gpu", "a100-80gb",
                 "--attn-implementation", "flash_attention_2", "--lora", adapter]  # fmt: skip
        key = f"qwen-{row['params']}-{row['method']}"
        return key, QWEN[row["params"]], flags, "c_attn's LoRA as q, k and v's"
    if repo == "Lightning-AI/litgpt":
        name = next((k for k in LITGPT if row["model"].startswith(k)), None)
        if name is None:
            return f"no config here for {row['model']}"
        config, targets = LITGPT[name]
        lora = row["lora"]
        adapter = {
            "peft_type": "LORA",
            "r": lora["r"],
            "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"],
            "target_modules": targets,
            "bias": "none",
            "modules_to_save": None,
        }
        world = row["num_gpus"]
        if world > 1:
            return (
                f"not modelled: FSDP over {world} GPUs with bf16-true parameters (litgpt ran "
                "FSDP1; the estimate's FSDP2 model takes float32 trainable parameters)"
            )
        flags = ["--seq-len", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]),
                 "--effective-batch", str(row["micro_batch"] * row["grad_accum"]),
                 "--precision", "bf16-true",
                 "--checkpointing", "on" if row["gradient_checkpointing"] else "off",
                 "--gpu", "a100-40gb", "--attn-implementation", "sdpa",
                 "--lora", adapter]  # fmt: skip
        said = "litgpt's chunked head loss as the model's own (its logits whole, upcast)"
        if row["method"] == "qlora":
            flags += ["--quantize", "nf4"]
            if "double" in row["quantization"]:
                flags.append("--double-quant")
            said += "; Fabric's nf4 head kept bf16 (as bitsandbytes under PEFT keeps it)"
        key = f"litgpt-{name.replace(' ', '-').lower()}-{row['method']}"
        return key, config, flags, said
    return _NOT_MODELLED.get(repo, f"not asked: {row['framework']}")


_NOT_MODELLED = {
    "pytorch/torchtune": "not modelled: torchtune's chunked cross-entropy, compile and "
    "activation offloading",
}


def case_of(row: dict, config: dict, flags: list) -> dict:
    """The configuration as the peers take it (bench/peer_estimators.py's ``case``), read
    off the command's own flags for the row: the same run, asked of each."""
    value = {
        flags[i]: flags[i + 1] for i in range(len(flags) - 1) if str(flags[i]).startswith("--")
    }
    micro = int(value["--micro-batch"])
    lora = value.get("--lora")
    return {
        "config": config, "params": parameters(config, value.get("--task", "causal-lm")),
        "seq_len": int(value["--seq-len"]), "micro_batch": micro,
        "grad_accum": int(value["--effective-batch"]) // micro,
        # bf16-true as each peer's bf16 (theirs hold the weights in bf16 too)
        "precision": value["--precision"].removesuffix("-true"),
        "optimizer": value.get("--optimizer", "adamw"),
        "lora": None if lora is None else {
            "r": lora["r"], "alpha": lora["lora_alpha"], "target_modules": lora["target_modules"],
            "modules_to_save": lora["modules_to_save"]},
        # a GPTQ int4 base (config.json's quantization_config) as each peer's 4-bit: none
        # models GPTQ's layout
        "quantization": value.get("--quantize") or ("nf4" if "quantization_config" in config
                                                    else None),
        "checkpointing": value["--checkpointing"] == "on",
        "gpu": value["--gpu"], "task": value.get("--task", "causal-lm"),
        "attention": value.get("--attn-implementation"),
    }  # fmt: skip


def parameters(config: dict, task: str) -> int:
    """The model's parameter count, built on the meta device from its config (no weights)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config)
    auto = (
        transformers.AutoModelForSequenceClassification
        if task == "sequence-classification"
        else transformers.AutoModelForCausalLM
    )
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def ask_peers(row: dict, config: dict, flags: list) -> dict:
    """Each peer's answer for the row (bytes and what it said, or why it cannot say)."""
    from peer_estimators import PEERS as NAMES
    from peer_estimators import ask

    world = flags[flags.index("--world-size") + 1] if "--world-size" in flags else "1"
    if world != "1":  # none of the five takes a world size or a sharding
        return {p: {"why": f"FSDP over {world} GPUs: no world size in its input"} for p in NAMES}
    return ask(case_of(row, config, flags))


def published_bytes(row: dict) -> tuple[float, str]:
    """The published number in bytes, and the unit it was read in."""
    unit = row["unit"]
    if unit.startswith("MiB"):
        return row["value"] * MiB, "MiB"
    if unit.startswith("GB (1e9"):
        return row["value"] * GB, "GB"
    if unit.startswith("G as written"):
        return row["value"] * GiB, "G as GiB"  # Qwen's 'G' (GB or GiB unstated): both shown
    raise ValueError(f"unit {unit!r} not read here")


BAND = HERE.parent / "src" / "gradaccum" / "planning" / "estimate" / "band.json"


def kind(flags: list, config: dict) -> str:
    """The kind of run a row's command asks (gradaccum.planning.estimate.band.kind_of): a
    base quantized by a flag or by its config.json, LoRA, or full training."""
    if "--quantize" in flags or "quantization_config" in config:
        return "qlora"
    return "lora" if "--lora" in flags else "full"


def write_band(asked: list[dict], at: str) -> None:
    """band.json: for each kind of run, how many rows and the lowest and highest of
    measured / estimate - 1 (what the estimate states beside its number)."""
    rows = {r["id"]: r for r in map(json.loads, ROWS.read_text().splitlines()) if r}
    kinds: dict[str, list[float]] = {}
    for a in asked:
        _, config, flags, _ = express(rows[a["id"]])
        a["kind"] = kind(flags, config)
        kinds.setdefault(a["kind"], []).append(1 / (1 + a["error"]) - 1)
    out = {
        "source": f"bench/results/published.md at {at}",
        "kinds": {k: {"rows": len(v), "low": round(min(v), 4), "high": round(max(v), 4)}
                  for k, v in sorted(kinds.items())},
    }  # fmt: skip
    BAND.write_text(json.dumps(out, indent=1) + "\n")


def compared(row: dict) -> str:
    """The estimate's number that reads as the row's meter: ``allocated`` for
    ``torch.cuda.max_memory_allocated``, else the device total (nvidia-smi's view)."""
    return "allocated" if row["meter"].startswith("torch.cuda.max_memory_allocated") else "total"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="row ids, comma-separated")
    parser.add_argument("--render", action="store_true", help="rewrite the page from the "
                        "last run's published.json (the rows not asked said again)")  # fmt: skip
    parser.add_argument("--peers", action="store_true", help="ask the peers alone, for the "
                        "rows of the last run's published.json")  # fmt: skip
    args = parser.parse_args()
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    if args.peers:
        asked = json.loads((HERE / "results" / "published.json").read_text())["asked"]
        by_id = {r["id"]: r for r in rows}
        for a in asked:
            _, config, flags, _ = express(by_id[a["id"]])
            a["peers"] = ask_peers(by_id[a["id"]], config, flags)
            print(a["id"], {k: v.get("bytes", "-") for k, v in a["peers"].items()}, flush=True)
        done = {a["id"] for a in asked}
        write(asked, [(r, _why(r)) for r in rows if r["id"] not in done], _estimates_at())
        return
    if args.render:
        asked = json.loads((HERE / "results" / "published.json").read_text())["asked"]
        done = {a["id"] for a in asked}
        write(asked, [(r, _why(r)) for r in rows if r["id"] not in done], _estimates_at())
        return
    if args.only:
        rows = [r for r in rows if r["id"] in args.only.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="published-"))
    asked, apart = [], []
    for row in rows:
        how = express(row)
        if isinstance(how, str):
            apart.append((row, how))
            continue
        key, config, flags, assumed = how
        folder = tmp / key
        if not folder.exists():
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
        flags = list(flags)
        if "--deepspeed" in flags:  # the DeepSpeed configuration as its own file
            at = flags.index("--deepspeed") + 1
            (folder / "ds_config.json").write_text(json.dumps(flags[at]))
            flags[at] = str(folder / "ds_config.json")
        if "--lora" in flags:  # the adapter as its own adapter_config.json
            at = flags.index("--lora") + 1
            (folder / "adapter").mkdir(exist_ok=True)
            (folder / "adapter" / "adapter_config.json").write_text(json.dumps(flags[at]))
            flags[at] = str(folder / "adapter")
        env = {**os.environ, "OMP_NUM_THREADS": "2", "GRADACCUM_PLAN_CACHE": str(tmp / f"c-{key}")}
        cmd = [sys.executable, "-m", "gradaccum", "plan", "--device", "cuda", "--hf-model",
               str(folder), *flags, "--json"]  # fmt: skip
        load = os.getloadavg()[0]
        began = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - began
        value, unit = published_bytes(row)
        try:
            est = json.loads(done.stdout)
        except json.JSONDecodeError:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            apart.append((row, f"the estimate failed: {last[:200]}"))
            continue
        result = {"id": row["id"], "model": key, "seq_len": row["seq_len"],
                  "micro_batch": row["micro_batch"], "published": row["value"], "unit": unit,
                  "meter": row["meter"], "total": est["total"], "reserved": est["reserved"],
                  "allocated": est["allocated"], "compared": compared(row),
                  "kind": kind(flags, config),
                  "error": est[compared(row)] / value - 1,
                  "error_gb": est["total"] / (row["value"] * GB) - 1 if "G as" in unit else None,
                  "wall": took, "load": load, "assumed": assumed,
                  "source": f"{row['source']['repo']}/{row['source']['path']}"}  # fmt: skip
        result["peers"] = ask_peers(row, config, how[2])
        asked.append(result)
        said = f"estimate {est['total'] / GiB:.2f} GiB ({result['error']:+.1%}), {took:.1f} s"
        print(f"{row['id']} {key} {row['seq_len']}: published {row['value']} {unit}, {said}")
    if args.only:  # the rows run again, in the last run's page
        last = json.loads((HERE / "results" / "published.json").read_text())["asked"]
        again = {a["id"] for a in asked}
        asked = sorted([a for a in last if a["id"] not in again] + asked, key=lambda a: a["id"])
        everything = [json.loads(line) for line in ROWS.read_text().splitlines() if line]
        done = {a["id"] for a in asked}
        apart = [(r, _why(r)) for r in everything if r["id"] not in done]
    write(asked, apart)


PEERS = ("fitcheck-llm", "ftuneai", "alloc", "gpu-estimator", "hf-vram-calc")


def _published(a: dict) -> float:
    # the published number in bytes, as the row read it
    return a[a.get("compared", "total")] / (1 + a["error"])


def _peer_error(a: dict, peer: str) -> float | None:
    got = a.get("peers", {}).get(peer, {})
    return got["bytes"] / _published(a) - 1 if "bytes" in got else None


def _peer_cell(a: dict, peer: str) -> str:
    error = _peer_error(a, peer)
    return "-" if error is None else f"{error:+.1%}"


def peer_summary(asked: list[dict]) -> list[str]:
    """One line per estimator over the same rows: how many it answered, its |error| median,
    how many it put under the published number by more than 5% and 10% (the crash)."""
    if not any("peers" in a for a in asked):
        return []
    out = [
        "The same rows asked of the peer estimators (bench/peer_estimators.py: each from the "
        "package index, given the row's configuration as far as its own API takes it; '-' "
        "where it cannot express the run: a LoRA run asked of one that models full "
        "fine-tuning only). Each against the published number as read above (Qwen's 'G' as "
        "GiB).",
        "",
        "| estimator | rows answered | abs error, median | under by more than 5% | "
        "under by more than 10% | over by more than 10% |",
        "|---|---|---|---|---|---|",
    ]
    named = [("gradaccum", [a["error"] for a in asked])]
    named += [(p, [e for a in asked if (e := _peer_error(a, p)) is not None]) for p in PEERS]
    for name, errors in named:
        if not errors:
            out.append(f"| {name} | 0 | - | - | - | - |")
            continue
        out.append(
            f"| {name} | {len(errors)} of {len(asked)} | "
            f"{statistics.median(abs(e) for e in errors):.1%} | "
            f"{sum(e < -0.05 for e in errors)} | {sum(e < -0.10 for e in errors)} | "
            f"{sum(e > 0.10 for e in errors)} |"
        )
    return [*out, ""]


def peer_notes(asked: list[dict]) -> list[str]:
    """What each peer said it left out, once per peer and model (the first row's words)."""
    if not any("peers" in a for a in asked):
        return []
    out = [
        "",
        "## What each peer was given and left out (its own words, first row of each model)",
        "",
    ]
    seen = set()
    for a in asked:
        for peer, got in a.get("peers", {}).items():
            if (peer, a["model"]) in seen:
                continue
            seen.add((peer, a["model"]))
            text = got.get("said") or f"not asked: {got.get('why')}"
            out.append(f"- {peer}, {a['model']}: {text.replace('|', '/')}")
    return out


def _why(row: dict) -> str:
    how = express(row)
    return how if isinstance(how, str) else "the estimate failed (see the last full run)"


def _estimates_at() -> str:
    """The commit the last full run's estimates were made at (kept by --peers and
    --render, which make none)."""
    last = json.loads((HERE / "results" / "published.json").read_text())
    return last.get("estimates_at", "bf5abd9")  # (the first run's, before this was kept)


def write(asked: list[dict], apart: list[tuple[dict, str]], at: str | None = None) -> None:
    out = HERE / "results"
    at = at or commit()
    write_band(asked, at)  # (each row's kind kept in published.json too)
    (out / "published.json").write_text(json.dumps({"estimates_at": at, "asked": asked, "apart": [
        {"id": r["id"], "why": why} for r, why in apart]}, indent=1))  # fmt: skip
    errors = [abs(a["error"]) for a in asked]
    lines = [
        "# The estimate against published GPU measurements",
        "",
        f"`python bench/published.py` at {commit()} on {describe(2)} (the estimates made "
        f"at {at}; the peers asked at {commit()}). The rows: "
        "[bench/published/rows.jsonl](../published/rows.jsonl), how each was pinned: "
        "[bench/published/SOURCES.md](../published/SOURCES.md). Each row asked is one "
        "`gradaccum plan --device cuda --hf-model DIR ... --json` (the model's config.json "
        "written from its published shape); the estimate's device total (nvidia-smi's view: "
        "reserved plus the CUDA context) against the published number.",
        "",
        f"Asked: {len(asked)} rows; |error| median "
        f"{statistics.median(errors):.1%}, largest {max(errors):.1%}; under by more than 5%: "
        f"{sum(a['error'] < -0.05 for a in asked)}; not asked: {len(apart)}."
        if asked
        else "Nothing asked.",
        "",
        *peer_summary(asked),
        "| row | model | tokens | micro-batch | published | estimate (total) | error | "
        "error (G as GB) | allocated | reserved | meter | wall | load |"
        + "".join(f" {peer} |" for peer in PEERS),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(PEERS),
    ]
    for a in asked:
        gb = f"{a['error_gb']:+.1%}" if a["error_gb"] is not None else "-"
        theirs = "".join(f" {_peer_cell(a, peer)} |" for peer in PEERS)
        lines.append(
            f"| {a['id']} | {a['model']} | {a['seq_len']} | {a['micro_batch']} | "
            f"{a['published']} {a['unit']} | {a['total'] / GiB:.2f} GiB | {a['error']:+.1%} | "
            f"{gb} | {a['allocated'] / GiB:.2f} GiB | {a['reserved'] / GiB:.2f} GiB | "
            f"{a['meter'][:40]} | {a['wall']:.1f} s | {a['load']:.2f} |{theirs}"
        )
    lines += peer_notes(asked)
    lines += ["", "## Not asked", "", "| row | source | method | why |", "|---|---|---|---|"]
    for r, why in apart:
        lines.append(
            f"| {r['id']} | {r['source']['repo']} | {r['method']} | {why.replace('|', '/')} |"
        )
    (out / "published.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'published.md'}")


if __name__ == "__main__":
    main()
