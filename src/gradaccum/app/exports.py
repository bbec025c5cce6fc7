"""The weights in formats other tools load, under a run folder's ``export/``: the LoRA adapter
(PEFT's save_pretrained), with --merge-lora the merged model, and for a full fine-tune of
--hf-model the model itself (save_pretrained, safetensors), the tokenizer beside each. The
loop writes them; the planner writes them once into a temporary folder to measure the
memory they take (a merge copies the whole model)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from gradaccum.app.config import TrainConfig


def write_exports(
    cfg: TrainConfig,
    model: torch.nn.Module,
    out: Path,
    whole: dict[str, torch.Tensor] | None = None,
) -> list[Path]:
    """The folders written under ``out``, each whole (a temporary sibling, then a rename);
    none for a built-in recipe. Under FSDP2, ``whole`` is the model's state_dict gathered
    from the shards."""
    if cfg.source.hf_model is None:
        return []
    from gradaccum.integrations import peft as finetune

    tokenizer = _tokenizer(cfg.source.hf_model)
    if cfg.model.lora is not None:
        written = [finetune.save_adapter(model, out / "adapter", tokenizer)]
        if cfg.output.merge_lora:
            written.append(finetune.save_merged(model, out / "merged", tokenizer))
        return written
    return [finetune.save_full(model, out / "model", tokenizer, state_dict=whole)]


@functools.cache  # read once per run, however often it exports
def _tokenizer(path: str):
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    from gradaccum.integrations import hf_models

    return hf_models.tokenizer(path)
