"""Activation checkpointing: recompute a model's repeated blocks in backward.

Saved activations grow with the micro-batch; recomputing each block's activations in
backward instead of saving them trades one more forward per block for most of that memory.
The planner turns it on when nothing fits without it. (Not to be confused with run
checkpoints, the saved training state of ``gradaccum.checkpoint``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "checkpointing_enabled",
    "disable_checkpointing",
    "enable_checkpointing",
    "repeated_blocks",
]


def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks: children of every ``nn.ModuleList`` that holds two or
    more modules of one type (a transformer's layers)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            if len({type(child) for child in module}) == 1:
                found.extend((f"{name}.{i}" if name else str(i), c) for i, c in enumerate(module))
    return found


# a block's key/value cache, by the names transformers' layers take it under: a block that
# wrote to it would write again when backward recomputes it (as transformers' own
# GradientCheckpointingLayer, the cache is not used while a block is checkpointed)
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


def enable_checkpointing(model: torch.nn.Module) -> list[str]:
    """Recompute each repeated block's activations in backward instead of saving them
    (``torch.utils.checkpoint``, non-reentrant, random state preserved so dropout replays
    the same masks). Parameter names and ``state_dict`` keys do not change. Returns the
    names of the wrapped blocks; refuses a model with none.

    A model that caches keys and values (a Hugging Face config's ``use_cache``) does not
    while its blocks are checkpointed, as with transformers' own checkpointing: a block's
    recomputation would append to the cache again and attend to both copies (GPT-2's
    gradient came out wrong; eager attention failed on the mask)."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks to checkpoint (an nn.ModuleList of "
            "two or more modules of one type)"
        )
    for _, block in blocks:
        if getattr(block, "_gradaccum_plain_forward", None) is not None:
            continue
        plain = block.forward

        def forward(*args: Any, _plain: Callable[..., Any] = plain, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                if kwargs.get("use_cache"):
                    kwargs["use_cache"] = False
                for name in _CACHES:
                    if kwargs.get(name) is not None:
                        kwargs[name] = None
                return torch.utils.checkpoint.checkpoint(
                    _plain, *args, use_reentrant=False, **kwargs
                )
            return _plain(*args, **kwargs)

        block._gradaccum_plain_forward = plain
        block.forward = forward
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            module._gradaccum_use_cache = True
    return [name for name, _ in blocks]


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Undo ``enable_checkpointing``."""
    for _, block in repeated_blocks(model):
        plain = getattr(block, "_gradaccum_plain_forward", None)
        if plain is not None:
            del block.forward
            del block._gradaccum_plain_forward
    for module in model.modules():
        if getattr(module, "_gradaccum_use_cache", False):
            module.config.use_cache = True
            del module._gradaccum_use_cache


def checkpointing_enabled(model: torch.nn.Module) -> bool:
    return any(
        getattr(block, "_gradaccum_plain_forward", None) is not None
        for _, block in repeated_blocks(model)
    )
