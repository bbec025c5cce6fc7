"""Built-in models and data for the CLI and the examples; nothing is downloaded.

A recipe names a model, its loss in the ``(loss_sum, count)`` form, and a sample batch at
the largest shape the model will see (what the planner measures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.loss import causal_lm_loss

__all__ = ["RECIPES", "Recipe", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    build_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, Any]]
    sample_batch: Callable[[int], Any]  # n samples at their largest shape


def _gpt_config():
    from gradaccum.recipes.gpt import GPTConfig

    return GPTConfig(max_len=128, d_model=128, n_heads=4, n_layers=4)


def _gpt_model() -> torch.nn.Module:
    from gradaccum.recipes.gpt import GPT

    return GPT(_gpt_config())


def _gpt_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]):
    return causal_lm_loss(model(mb["input_ids"]), mb["labels"])


def _gpt_sample(n: int) -> dict[str, torch.Tensor]:
    from gradaccum.recipes.stdlib_text import corpus_bytes, full_length_batch

    return full_length_batch(corpus_bytes(), n, _gpt_config().max_len, seed=0)


RECIPES: dict[str, Recipe] = {
    "gpt": Recipe(
        name="gpt",
        summary="byte-level GPT (4 layers, d_model 128, 128 bytes) on the Python stdlib's source",
        build_model=_gpt_model,
        loss_fn=_gpt_loss,
        sample_batch=_gpt_sample,
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(sorted(RECIPES))}")
    return RECIPES[name]
