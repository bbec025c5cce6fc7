"""`gradaccum plan --device cuda` without a GPU (or with ``--estimate``): the fake-tensor
estimate of a recipe or a Hugging Face config, in a process of its own.

The trace runs in ``python -m gradaccum.app.estimating CONFIG OUT``, so that an op torch cannot
fake, or an abort inside torch, ends in one line and never takes the command down. With
``--micro-batch`` it estimates that size; otherwise the largest micro-batch whose device total
fits ``--budget`` (a window of two micro-batches peaks as one of any larger number: from the
second on, every buffer the window holds is there), and the micro-batches per window that make
``--effective-batch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradaccum.app import plan_cache
from gradaccum.app.config import PlanConfig
from gradaccum.app.process import say
from gradaccum.memory import format_bytes, parse_bytes

__all__ = ["estimate_command", "head_loss", "main", "render", "task_of"]


# what only says how to print a plan: a change of these is the same estimate
_NOT_KEYED = ("json", "plot", "replan", "export", "export_to", "meter", "margin", "prefer")


def estimate_command(cfg: PlanConfig) -> dict[str, Any]:
    """The estimate's result (``Estimate.to_dict()`` and the search): the plan cache's when it
    holds this estimate (``cached``: its file), else traced in its own process and stored; a
    ValueError with one line when the trace fails."""
    parts = _cache_key(cfg)
    if not cfg.replan and (found := _cached(parts)) is not None:
        return found
    result = _traced(cfg)
    plan_cache.store(parts, result)
    return {**result, "cached": None}


def _cache_key(cfg: PlanConfig) -> dict[str, Any]:
    """What the estimate depends on, known before anything is built: the settings, the
    --hf-model folder's files, gradaccum's source, the versions (transformers' too: its
    classes are the model), the machine."""
    import torch

    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_KEYED}
    settings = {"kind": "estimate", **settings}
    if cfg.hf_model is not None:
        import importlib.metadata

        settings["transformers"] = importlib.metadata.version("transformers")
    return plan_cache.signature(torch.device("cpu"), settings, (cfg.hf_model,))


def _cached(parts: dict[str, Any]) -> dict[str, Any] | None:
    """The stored estimate for ``parts``, or None; an entry that is not whole (its checksum)
    or not for these settings is said in one line and estimated over."""
    where = plan_cache.folder()
    path = None if where is None else where / f"{plan_cache.key(parts)}.json"
    if path is None or not path.is_file():  # a regular file only: never a FIFO's read
        return None
    started = time.perf_counter()
    try:
        entry = json.loads(path.read_text())
        body = {"key": entry["key"], "plan": entry["plan"]}
        if entry.get("sha256") != plan_cache.checksum(body) or body["key"] != parts:
            raise ValueError("does not match its checksum or these settings")
    except (OSError, ValueError, KeyError, TypeError) as err:
        say(
            f"gradaccum: warning: the cached estimate {path} is not one ({err}); estimating over it"
        )
        return None
    took = time.perf_counter() - started
    say(f"the estimate is the cached one ({path}, read in {took:.2f} s; --replan estimates again)")
    return {**body["plan"], "cached": str(path)}


def _traced(cfg: PlanConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gradaccum-estimate-") as tmp:
        config, out = Path(tmp, "estimate-request.json"), Path(tmp, "estimate-result.json")
        config.write_text(json.dumps(dataclasses.asdict(cfg)))
        done = subprocess.run(
            [sys.executable, "-m", "gradaccum.app.estimating", str(config), str(out)],
            capture_output=True,
            text=True,
        )
        if out.exists():
            result = json.loads(out.read_text())
            if "error" in result:
                raise ValueError(result["error"])
            return result["estimate"]
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    raise ValueError(f"the memory trace's process ended ({how}) without an estimate: {last}")


def render(result: dict[str, Any], budget: int | None) -> list[str]:
    """The estimate for a person: the summary, what it assumed, the table of parts."""
    fits = ""
    if budget is not None:
        word = "fits" if result["total"] <= budget else "does not fit"
        fits = f"; {word} the budget of {format_bytes(budget)}"
    lines = [
        f"ESTIMATE for {result['gpu']} (traced with fake tensors on this machine, not "
        f"measured): micro-batch {result['micro_batch']} x {result['per_window']} per window"
        f"{fits}",
    ]
    if result.get("largest"):
        lines.append(f"largest micro-batch that fits: {result['largest']}")
    lines += [f"assumed: {a}" for a in result["assumptions"]]
    rows = [("allocated (max_memory_allocated)", result["allocated"])]
    rows += [(f"  {name}", size) for name, size in result["parts"].items()]
    rows += [
        ("reserved (max_memory_reserved)", result["reserved"]),
        ("  CUDA context (assumed)", result["context"]),
        *([("  paged optimizer state", result["unified"])] if result.get("unified") else []),
        ("device total (nvidia-smi)", result["total"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines += ["", *(f"{name:<{width}}  {format_bytes(size):>10}" for name, size in rows)]
    return lines


# ----- the estimating process --------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m gradaccum.app.estimating CONFIG OUT``: writes {"estimate": ...} or
    {"error": one line} to OUT. Not a command: ``estimate_command`` runs it."""
    ap = argparse.ArgumentParser(prog="python -m gradaccum.app.estimating")
    ap.add_argument("config")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    from gradaccum.plan.estimate.trace import TraceError

    cfg = PlanConfig(**json.loads(Path(a.config).read_text()))
    try:
        result = _estimate(cfg)
    except (TraceError, ValueError, TypeError) as err:
        Path(a.out).write_text(json.dumps({"error": str(err).splitlines()[0]}))
        return 2
    Path(a.out).write_text(json.dumps({"estimate": result}))
    return 0


def _estimate(cfg: PlanConfig) -> dict[str, Any]:
    import gradaccum as ga

    model, sample, loss_fn, prepare, assumed = _workload(cfg)
    per_rank = math.ceil(cfg.effective_batch / cfg.world_size)

    def at(micro_size: int, windows: int = 2, sync: str = "window") -> ga.Estimate:
        return ga.estimate(
            model,
            _optimizer(cfg.optimizer),
            sample,
            loss_fn,
            micro_size=micro_size,
            micro_batches=min(windows, 2),
            gpu=cfg.gpu,
            precision=cfg.precision,
            checkpointing=cfg.checkpointing == "on",
            prepare=prepare,
            world_size=cfg.world_size,
            shard=cfg.shard,
            sync=sync,
        )

    budget = parse_bytes(cfg.budget)
    largest = None
    # under FSDP2 the plan's choice (plan(sync="auto")): "window" where it fits, else "micro"
    syncs = ("window", "micro") if cfg.shard == "fsdp" else ("window",)
    if cfg.micro_batch is not None:
        micro_size = cfg.micro_batch
        windows = math.ceil(per_rank / micro_size)
        for sync in syncs:
            est = at(micro_size, windows, sync)
            if est.total <= budget:
                break
        else:
            est = at(micro_size, windows) if len(syncs) > 1 else est
    else:
        best = None
        for sync in syncs:
            # the largest size whose total fits: memory grows with the micro-batch
            low, high = 1, per_rank
            while low <= high:
                mid = (low + high) // 2
                trial = at(mid, sync=sync)
                if trial.total <= budget:
                    low, best = mid + 1, (mid, trial)
                else:
                    high = mid - 1
            if best is not None:
                break
        if best is None:
            one = at(1, sync=syncs[-1])
            raise ValueError(
                f"even a micro-batch of 1 needs {format_bytes(one.total)} on {cfg.gpu}, over "
                f"--budget {cfg.budget}; try --checkpointing on, --precision bf16 or --lora"
            )
        micro_size, est = best
        largest = micro_size
    result = est.to_dict()
    result["per_window"] = math.ceil(per_rank / micro_size)
    result["largest"] = largest
    result["budget"] = budget
    if est.sync == "micro":
        assumed = [
            *assumed,
            "gradient sync micro, as the plan would choose: holding the whole unsharded "
            "gradient between micro-batches (window) does not fit the budget",
        ]
    if cfg.optimizer in _OPTIMIZER_ASSUMED:
        assumed = [*assumed, f"optimizer: {_OPTIMIZER_ASSUMED[cfg.optimizer]}"]
    result["assumptions"] = assumed + result["assumptions"]
    return result


def _optimizer(name: str):
    """The optimizer for ``--optimizer NAME``: torch's and transformers' Adafactor as they run
    (traced), bitsandbytes' 8-bit ones by their documented state layout (Blockwise8bit)."""
    import torch

    from gradaccum.plan.estimate.optimizers import Blockwise8bit

    def adafactor(p):
        from gradaccum.integrations import hf_models

        # the Trainer's --optim adafactor: no first moment (beta1=None), a fixed learning rate
        return hf_models.adafactor(p, lr=1e-4, scale_parameter=False, relative_step=False)

    makers = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        "adafactor": adafactor,
        "adamw8bit": lambda p: Blockwise8bit(p, states=2),
        "paged_adamw8bit": lambda p: Blockwise8bit(p, states=2, paged=True),
        "lion8bit": lambda p: Blockwise8bit(p, states=1),
    }
    return makers[name]


# what the estimate assumed of each optimizer that is not torch's own
_OPTIMIZER_ASSUMED = {
    "adafactor": "transformers' Adafactor (beta1=None: factored second moments, no first), "
    "traced as it runs",
    "adamw8bit": "bitsandbytes' AdamW8bit by its documented state layout (uint8 state1/state2, "
    "float32 absmax per 256 values, 256-entry maps; float32 states under 4,096 values), "
    "not traced: its step is one in-place kernel",
    "paged_adamw8bit": "bitsandbytes' PagedAdamW8bit by its documented state layout (as "
    "AdamW8bit; states of parameters of 100,000 values or more paged)",
    "lion8bit": "bitsandbytes' Lion8bit by its documented state layout (uint8 state1, float32 "
    "absmax per 256 values, a 256-entry map), not traced: its step is one in-place kernel",
}


# a configuration's architecture names its head: the class name's ending
_HEADS = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForMaskedLM": "masked-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForImageClassification": "image-classification",
}


def task_of(config: Any, given: str | None) -> str:
    """``--task``, else the head the configuration's ``architectures`` names, else a causal
    LM."""
    if given:
        return given
    for name in getattr(config, "architectures", None) or ():
        for ending, task in _HEADS.items():
            if name.endswith(ending):
                return task
    return "causal-lm"


def _workload(cfg: PlanConfig):
    """The model factory, sample, loss and LoRA step for the estimate, and what it assumed."""
    import torch

    from gradaccum.app.recipes import get_recipe, hf_recipe

    if cfg.hf_model is None:
        recipe = get_recipe(cfg.recipe)
        assumed = [f"recipe {recipe.name}: its own model and sample shape"]
        return recipe.build_model, recipe.sample_batch, recipe.loss_fn, None, assumed
    recipe = hf_recipe(cfg.hf_model)  # refuses remote code and unreadable configs
    from gradaccum.integrations import hf_models

    config = hf_models.config(cfg.hf_model)  # a folder or its config file
    task = task_of(config, cfg.task)
    if cfg.lora is not None and task != "causal-lm":
        raise ValueError(
            f"--lora with a {task} head is not modelled (PEFT trains a copy of the head beside "
            "the adapters); estimate it without --lora, or a causal LM"
        )
    images = task == "image-classification"
    if images and cfg.seq_len is not None:
        raise ValueError("--seq-len applies to text models; an image model's size is its config's")
    length = cfg.seq_len or 128
    low = cfg.lora is not None and cfg.precision == "bf16"
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # a decoder's head finds each sequence's last token by it
    if images:
        side = config.image_size
        shape = (config.num_channels, *(side if isinstance(side, (list, tuple)) else (side, side)))
        what = f"{shape[1]}x{shape[2]} images"
    else:
        what = f"{length} tokens per sequence"
    assumed = [
        f"{config.model_type} {task.replace('-', ' ')} from its config (random init: weights "
        f"never load), {what}",
    ]

    def build() -> torch.nn.Module:
        if not low:
            return hf_models.for_task(config, task)
        # built in bf16 (a conversion after the build would be one more copy)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return hf_models.for_task(config, task)
        finally:
            torch.set_default_dtype(previous)

    def sample(n: int) -> dict[str, torch.Tensor]:
        if images:
            return {"pixel_values": torch.zeros(n, *shape), "labels": torch.zeros(n).long()}
        ids = torch.zeros(n, length, dtype=torch.long)
        one = task == "sequence-classification"
        return {"input_ids": ids, "labels": torch.zeros(n).long() if one else ids}

    loss_fn = recipe.loss_fn if task == "causal-lm" else head_loss
    prepare = None
    if cfg.lora is not None:
        from gradaccum.integrations.peft import apply_lora

        def prepare(model: torch.nn.Module) -> torch.nn.Module:
            model = apply_lora(model, r=cfg.lora)
            if cfg.quantize is not None:
                from gradaccum.plan.estimate.quantized import quantize

                model = quantize(model, cfg.quantize, double_quant=cfg.double_quant)
            return model

        base = "bf16" if low else "fp32"
        assumed.append(
            f"LoRA r={cfg.lora} on the default attention projections, base frozen in {base}"
        )
        if cfg.quantize is not None:
            what = "Linear8bitLt" if cfg.quantize == "8bit" else f"Linear4bit {cfg.quantize}"
            assumed.append(
                f"base's linear layers but the output embedding as bitsandbytes' {what}"
                + (" with double quantization" if cfg.double_quant else "")
                + ", modelled by their documented layout ("
                + (
                    "int8 products; no outlier columns over the 6.0 threshold"
                    if cfg.quantize == "8bit"
                    else f"computing in {base}"
                )
                + f"; the other parameters stay in {base}: prepare_model_for_kbit_training's "
                "fp32 cast not applied)"
            )
    return build, sample, loss_fn, prepare, assumed


def head_loss(model: Any, batch: dict[str, Any]) -> tuple[Any, int]:
    """Cross-entropy summed over what is labelled (a token, a sequence or an image), and how
    many: a masked LM's, token or sequence classifier's or image classifier's loss."""
    import torch.nn.functional as F

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits, labels = model(**inputs).logits, batch["labels"]
    flat = logits.reshape(labels.numel(), -1)
    return F.cross_entropy(flat, labels.reshape(-1), reduction="sum"), labels.numel()


if __name__ == "__main__":
    sys.exit(main())
