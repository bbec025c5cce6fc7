"""Checks of what users pass in: the one integer check every count and size goes through,
and the Accumulator's arguments, all problems at once."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "check_arguments",
    "int_problem",
    "positive_int",
    "window_parameters",
]


def int_problem(value: Any, name: str, minimum: int = 1) -> str | None:
    """What is wrong with ``value`` as an integer >= ``minimum`` (a bool is not one), or None;
    for checks that collect every problem before raising."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return f"{name} must be an integer >= {minimum}, got {value!r}"
    return None


def positive_int(value: Any, name: str) -> int:
    """``value`` when it is an integer >= 1; else the ValueError naming it."""
    problem = int_problem(value, name)
    if problem is not None:
        raise ValueError(problem)
    return value


def check_arguments(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    max_grad_norm: Any,
    choices: dict[str, tuple[Any, tuple[str, ...]]] | None = None,
    **policies: tuple[Any, type],
) -> None:
    """Every problem with the Accumulator's arguments, raised at once: a TypeError when one is
    of the wrong kind, else a ValueError. ``choices``: name -> (a value, the names it may
    be; None: not a name, checked elsewhere); ``policies``: name -> (value, its class),
    each optional."""
    kinds = []
    if not isinstance(model, torch.nn.Module):
        kinds.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        kinds.append(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        kinds.append(f"scheduler must have a step() method, got {type(scheduler).__name__}")
    for name, (value, cls) in policies.items():
        if value is not None and not isinstance(value, cls):
            kinds.append(f"{name} must be {cls.__name__}(...) or None, got {value!r}")
    values = []
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not 0 < max_grad_norm < float("inf")
    ):
        values.append(
            f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}"
        )
    for name, (value, allowed) in (choices or {}).items():
        if value is not None and value not in allowed:
            values.append(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if kinds or values:
        raise (TypeError if kinds else ValueError)("; ".join(kinds + values))


def window_parameters(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Every parameter whose gradient the window produces (normalized and cleared, the
    optimizer's own extras such as a learned loss temperature outside the model included),
    and the ones that are normalized, measured, clipped and stepped: the optimizer's. A
    trainable parameter outside the optimizer only has its gradient cleared."""
    all_params = list(model.parameters())
    trainable = [p for p in all_params if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"model has no trainable parameters ({len(all_params)} parameters, none with "
            "requires_grad=True); there is nothing to accumulate"
        )
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    params = list({id(p): p for p in trainable + optimizer_params}.values())
    return params, [p for p in optimizer_params if p.requires_grad]
