"""Fine-tuning a Hugging Face causal LM: LoRA adapters through PEFT, and saving the result.

- ``apply_lora``: freeze the model and add LoRA adapters (PEFT's ``get_peft_model``), on the
  attention projections that suit the model unless told which layers.
- ``adapter_config`` and ``apply_adapter_config``: the LoRA a PEFT ``adapter_config.json``
  describes (its rank, alpha, dropout, target modules, "all-linear" too, and modules to save),
  as users configure it.
- ``save_adapter``: the adapters alone, in PEFT's format (``PeftModel.from_pretrained``).
- ``save_merged``: the adapters merged into a copy of the base weights, a plain Hugging Face
  model (``AutoModelForCausalLM.from_pretrained``); the model being trained keeps them.
- ``save_full``: a fully fine-tuned model, in Hugging Face's format.
- ``trainable_summary``: trainable parameters out of all, on one line.

The Accumulator needs nothing special: a frozen parameter never has a gradient, so the
window normalizes, clips and steps the adapters alone, and no optimizer keeps state for a
parameter it never steps. Give the optimizer the trainable parameters, to say so plainly.

Each save writes a whole folder (safetensors, the tokenizer beside the model when given):
into a temporary sibling folder first, then renamed into place, so a failure never leaves
half a model where a whole one is expected. PEFT and transformers are imported when a
function needs them: ``import gradaccum`` imports neither.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gradaccum.validate import int_problem

__all__ = [
    "adapter_config",
    "apply_adapter_config",
    "apply_lora",
    "save_adapter",
    "save_full",
    "save_merged",
    "trainable_summary",
]

# Tried in order; the first group whose names are all layers of the model is the default.
# The attention projections, as the LoRA paper and PEFT's own defaults adapt them.
DEFAULT_TARGETS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "v_proj"),  # llama, mistral, qwen2/3, gemma, opt, gpt-j, gpt-neo, phi
    ("c_attn",),  # gpt2, gpt_bigcode (transformers' Conv1D)
    ("query_key_value",),  # gpt-neox, bloom, falcon
    ("qkv_proj",),  # codegen, phi-3
    ("Wqkv",),  # mpt
    ("query", "value"),  # bert-style encoders
)


def apply_lora(
    model: torch.nn.Module,
    r: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: Sequence[str] | None = None,
) -> Any:
    """``model`` frozen, with LoRA adapters of rank ``r`` on ``targets``: a PEFT model
    (``task_type`` CAUSAL_LM) whose only trainable parameters are the adapters.

    ``alpha``: the LoRA scaling numerator (updates are scaled by ``alpha / r``); by default
    ``2 * r``. ``dropout``: on the adapters' input, in [0, 1). ``targets``: names of the
    layers to adapt (the last part of a module's name, as PEFT's ``target_modules``); by
    default the attention projections, found by name (``DEFAULT_TARGETS``): ``q_proj`` and
    ``v_proj`` (Llama, Mistral, Qwen and most others), ``c_attn`` (GPT-2),
    ``query_key_value`` (GPT-NeoX, Falcon), ... A model with none of them needs ``targets``.
    Every problem with the arguments is one ValueError; a model that is not a Hugging Face
    causal LM is a TypeError.
    """
    problems = _lora_problems(r, alpha, dropout, targets)
    if problems:
        raise ValueError("cannot apply LoRA: " + "; ".join(problems))
    if not callable(getattr(model, "prepare_inputs_for_generation", None)):
        # what PEFT's causal-LM wrapper calls; a plain module fails there, obscurely
        raise TypeError(
            f"apply_lora needs a Hugging Face causal LM (e.g. from AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    from peft import LoraConfig, get_peft_model

    names = list(targets) if targets is not None else default_targets(model)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r if alpha is None else alpha,
        lora_dropout=float(dropout),
        target_modules=names,
        # GPT-2's layers are transformers' Conv1D, whose weight is stored transposed
        # (in, out). PEFT flips this flag itself when it meets one, with a warning each
        # time; said up front, the adapter's saved config says so too.
        fan_in_fan_out=_all_conv1d(model, names),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def adapter_config(path: str | Path) -> Any:
    """PEFT's ``LoraConfig`` from an ``adapter_config.json`` (or a folder holding one), for
    training: ``inference_mode`` off (a saved adapter's config has it on, which would freeze
    the adapters too). ValueError naming the file for anything that is not a LoRA config."""
    import json

    from peft import LoraConfig

    file = Path(path)
    file = file / "adapter_config.json" if file.is_dir() else file
    try:
        if file.stat().st_size > 1 << 20:
            raise ValueError(f"{file} is {file.stat().st_size} bytes, not an adapter config")
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not a readable adapter_config.json ({err})") from None
    if not isinstance(data, dict) or data.get("peft_type", "LORA") != "LORA":
        kind = data.get("peft_type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{file} is not a LoRA adapter config (peft_type {kind!r})")
    known = set(LoraConfig.__dataclass_fields__)
    given = {k: v for k, v in data.items() if k in known and k not in ("peft_type",)}
    given.update(inference_mode=False, task_type=given.get("task_type") or "CAUSAL_LM")
    try:
        return LoraConfig(**given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{file}: {str(err).splitlines()[0]}") from None


def apply_adapter_config(model: torch.nn.Module, path: str | Path) -> Any:
    """``model`` frozen, with the LoRA adapters (and trained copies of the modules to save)
    that ``adapter_config(path)`` describes: a PEFT model."""
    from peft import get_peft_model

    return get_peft_model(model, adapter_config(path))


def default_targets(model: torch.nn.Module) -> list[str]:
    """The first group of ``DEFAULT_TARGETS`` that ``model`` has, or the ValueError naming
    the model's type and the layers it has."""
    layers = _layer_names(model)
    for group in DEFAULT_TARGETS:
        if set(group) <= layers:
            return list(group)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    kind = f"{model_type!r} ({type(model).__name__})" if model_type else type(model).__name__
    shown = ", ".join(sorted(layers)) if layers else "none"
    raise ValueError(
        f"no default LoRA target for model type {kind}: none of "
        f"{', '.join('+'.join(g) for g in DEFAULT_TARGETS)} among its linear layers "
        f"({shown}); pass targets=[...] naming the layers to adapt"
    )


def save_adapter(model: Any, folder: str | Path, tokenizer: Any = None) -> Path:
    """The adapters of ``model`` (from :func:`apply_lora`) in PEFT's format, safetensors,
    ``tokenizer`` beside them when given: load with ``PeftModel.from_pretrained(base_model,
    folder)``, or ``AutoPeftModelForCausalLM.from_pretrained(folder)``, which finds the
    base where ``adapter_config.json``'s ``base_model_name_or_path`` says (the path the base
    was loaded from: load it by an absolute path for the adapter to load from anywhere)."""
    _require_peft(model, "save_adapter")

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return _write_folder(folder, write)


def save_merged(model: Any, folder: str | Path, tokenizer: Any = None) -> Path:
    """The adapters of ``model`` merged into its base weights, saved as a plain Hugging
    Face model (safetensors) that ``AutoModelForCausalLM.from_pretrained`` loads without
    PEFT; ``tokenizer`` beside it when given. The merge runs on a copy (memory for a second
    model), so ``model`` keeps its adapters and can go on training."""
    _require_peft(model, "save_merged")
    merged = copy.deepcopy(model).merge_and_unload()
    return _write_folder(folder, lambda tmp: _save_pretrained(merged, tokenizer, tmp))


def save_full(
    model: torch.nn.Module,
    folder: str | Path,
    tokenizer: Any = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A fully fine-tuned Hugging Face model in its own format (safetensors), ``tokenizer``
    beside it when given. ``state_dict``: the weights to write instead of the model's own
    (an FSDP2 model's, gathered from its shards)."""
    if _is_peft(model):
        raise TypeError(
            "save_full got a model with LoRA adapters; save them with save_adapter, or the "
            "merged model with save_merged"
        )
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(
            f"save_full needs a Hugging Face model (one with save_pretrained), got "
            f"{type(model).__name__}; save a plain module's state_dict with torch.save"
        )
    return _write_folder(
        folder, lambda tmp: _save_pretrained(model, tokenizer, tmp, state_dict=state_dict)
    )


def trainable_summary(model: torch.nn.Module) -> str:
    """One line: trainable parameters out of all (each shared parameter counted once)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    share = 100 * trainable / total if total else 0.0
    return f"trainable parameters: {trainable:,} of {total:,} ({share:.2f}%)"


# -- helpers ----------------------------------------------------------------------------------


def _lora_problems(r: Any, alpha: Any, dropout: Any, targets: Any) -> list[str]:
    problems = []
    if (problem := int_problem(r, "r")) is not None:
        problems.append(problem)
    if alpha is not None and not (_is_number(alpha) and 0 < alpha < math.inf):
        problems.append(f"alpha must be a positive number or None (2 * r), got {alpha!r}")
    if not (_is_number(dropout) and 0 <= dropout < 1):
        problems.append(f"dropout must be a fraction in [0, 1), got {dropout!r}")
    if targets is not None and (
        isinstance(targets, str)
        or not isinstance(targets, Sequence)
        or not targets
        or not all(isinstance(t, str) and t for t in targets)
    ):
        problems.append(f"targets must be a non-empty list of layer names or None, got {targets!r}")
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Full name -> module for each layer LoRA can adapt here: Linear, transformers' Conv1D."""
    from transformers.pytorch_utils import Conv1D

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D))
    }


def _layer_names(model: torch.nn.Module) -> set[str]:
    """The layers' names as targets name them: the last part, or the last two when the last
    is an index into a Sequential ("mlp.0")."""
    names = set()
    for name in _linear_layers(model):
        parts = name.split(".")
        names.add(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1])
    return names


def _all_conv1d(model: torch.nn.Module, targets: list[str]) -> bool:
    from transformers.pytorch_utils import Conv1D

    chosen = [m for name, m in _linear_layers(model).items() if name.rsplit(".", 1)[-1] in targets]
    return bool(chosen) and all(isinstance(m, Conv1D) for m in chosen)


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # without PEFT installed no model can be one
        return False
    return isinstance(model, PeftModel)


def _require_peft(model: Any, what: str) -> None:
    if not _is_peft(model):
        raise TypeError(
            f"{what} needs a model with LoRA adapters (from apply_lora), got "
            f"{type(model).__name__}; save a full fine-tune with save_full"
        )


def _save_pretrained(model: Any, tokenizer: Any, folder: Path, state_dict: Any = None) -> None:
    model.save_pretrained(folder, state_dict=state_dict)  # safetensors since 4.35
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _write_folder(folder: str | Path, write: Callable[[Path], Any]) -> Path:
    """Run ``write(tmp)`` into a new sibling folder, then rename it to ``folder``.

    A failure removes the temporary folder and leaves ``folder`` as it was. An existing
    ``folder`` is moved aside, replaced, then removed: at every moment ``folder`` is the
    old whole version, the new whole version, or (between the two renames) missing."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"cannot write {folder}: it is a file, not a folder")
    tag = f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp, old = folder.with_name(tag + ".tmp"), folder.with_name(tag + ".old")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        write(tmp)
        if folder.exists():
            os.replace(folder, old)
            try:
                os.replace(tmp, folder)
            except OSError:
                os.replace(old, folder)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"cannot write {folder}: {err.strerror or err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
