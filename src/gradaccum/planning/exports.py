"""A plan as another framework's settings: Transformers, Lightning, Accelerate, DeepSpeed.

Frameworks run equal micro-batches: micro-batch ``m`` on each of ``w`` ranks, ``a``
accumulation steps, ``m * a * w`` samples per optimizer step. A plan may end its window
with a smaller micro-batch, so the export looks for an equal split of the same effective
batch, never a rounded one: the planned micro-batch when it divides the per-rank batch,
else the largest divisor below it down to half its size (it fits: it is smaller); else it
refuses, naming the effective batches near the request that do divide.

The export gives the batch shape. Frameworks divide each micro-batch's mean loss by the
accumulation steps, which is the large batch's mean only when every micro-batch counts
the same (a per-sample mean over equal micro-batches); a per-token loss over padded or
ragged sequences needs gradaccum's integrations for the exact gradient.

Plain dicts and text only: no framework is imported here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gradaccum.validate import int_problem

if TYPE_CHECKING:
    from gradaccum.planning.result import Plan

__all__ = ["FRAMEWORKS", "BatchShape", "Export", "equal_split", "export"]

FRAMEWORKS = ("transformers", "lightning", "accelerate", "deepspeed")

# each framework's name for the plan's precision (autocast name -> setting)
_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class Export:
    """One framework's settings for a plan.

    ``settings``: the keyword arguments of the framework's own object (``TrainingArguments``,
    Lightning's ``Trainer``, ``Accelerator``), or DeepSpeed's config dict. ``micro_size`` is
    the per-rank DataLoader batch size. ``snippet``: Python to paste, or for DeepSpeed the
    config as strict JSON (what ``json.load`` reads: Accelerate and Transformers load
    DeepSpeed config files that way). ``comments``: the arithmetic, then what else the
    setup needs; the Python snippets carry them as ``#`` lines, ``str()`` adds them to JSON.
    """

    framework: str
    effective_batch: int
    world_size: int
    micro_size: int
    accumulation_steps: int
    precision: str
    settings: dict[str, Any]
    snippet: str
    comments: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.framework != "deepspeed":
            return self.snippet  # its comments are in it
        return "\n".join([*(f"# {line}" for line in self.comments), self.snippet])


@dataclass(frozen=True)
class BatchShape:
    """What an export reads of a plan, for a batch shape that no ``Plan`` holds: the one a
    memory estimate chose for a GPU that is not here. ``zero_stage`` 3: the model sharded
    over the ranks (FSDP2's ``fully_shard`` in the estimate, ZeRO stage 3 in DeepSpeed)."""

    effective_batch: int
    world_size: int
    micro_size: int
    precision: str
    checkpointing: bool
    zero_stage: int = 0


def equal_split(effective_batch: int, world_size: int, micro_size: int) -> tuple[int, int]:
    """``(m, a)`` with ``m * a * world_size == effective_batch`` exactly, ``m`` the largest
    divisor of the per-rank batch that is at most ``micro_size`` and at least half of it;
    otherwise a ValueError with the nearest effective batches that divide."""
    problems = [
        p
        for p in (
            int_problem(effective_batch, "effective_batch"),
            int_problem(world_size, "world_size"),
            int_problem(micro_size, "micro_size"),
        )
        if p is not None
    ]
    if problems:
        raise ValueError("cannot export: " + "; ".join(problems))
    if effective_batch % world_size:
        raise ValueError(
            f"cannot export: effective_batch {effective_batch} does not divide over "
            f"world_size {world_size} ranks ({effective_batch} = {world_size} x "
            f"{effective_batch // world_size} + {effective_batch % world_size}); frameworks "
            f"give every rank the same batch, choose a multiple of {world_size}"
        )
    per_rank = effective_batch // world_size
    top = min(micro_size, per_rank)
    lowest = (top + 1) // 2  # half the planned micro-batch, rounded up
    for m in range(top, lowest - 1, -1):
        if per_rank % m == 0:
            return m, per_rank // m
    unit = top * world_size
    below, above = effective_batch // unit * unit, (effective_batch // unit + 1) * unit
    raise ValueError(
        f"cannot export effective_batch {effective_batch} as equal micro-batches: the "
        f"per-rank batch {per_rank} has no divisor from {lowest} to the planned micro-batch "
        f"{top} (frameworks need micro-batch x steps x ranks = {effective_batch} exactly); "
        f"effective_batch {below} or {above} divides at micro-batch {top} x {_ranks(world_size)}"
    )


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def export(plan: Plan | BatchShape, framework: str) -> Export:
    """``plan`` as ``framework``'s settings and snippet (see ``Plan.export``)."""
    problems = []
    if framework not in FRAMEWORKS:
        problems.append(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")
    if plan.precision not in _LIGHTNING_PRECISION:
        problems.append(
            f"precision must be one of {', '.join(_LIGHTNING_PRECISION)}, got {plan.precision!r}"
        )
    if problems:
        raise ValueError("cannot export: " + "; ".join(problems))
    micro_size, steps = equal_split(plan.effective_batch, plan.world_size, plan.micro_size)
    w = plan.world_size
    comments = [
        f"micro-batch {micro_size} x {steps} accumulation steps x {_ranks(w)} = "
        f"{plan.effective_batch} samples per optimizer step"
    ]
    if micro_size != plan.micro_size:
        comments.append(
            f"micro-batch {micro_size}, not the planned {plan.micro_size}: the largest that "
            f"divides the per-rank batch {plan.effective_batch // w}"
        )
    build = {
        "transformers": _transformers,
        "lightning": _lightning,
        "accelerate": _accelerate,
        "deepspeed": _deepspeed,
    }[framework]
    settings, extra, snippet = build(plan, micro_size, steps)
    comments += extra
    if framework != "deepspeed":
        snippet = "\n".join([*(f"# {line}" for line in comments), snippet])
    return Export(
        framework=framework,
        effective_batch=plan.effective_batch,
        world_size=w,
        micro_size=micro_size,
        accumulation_steps=steps,
        precision=plan.precision,
        settings=settings,
        snippet=snippet,
        comments=tuple(comments),
    )


def _py(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _call(target: str, kwargs: dict[str, Any], first: dict[str, Any] | None = None) -> str:
    args = {**(first or {}), **kwargs}
    lines = [f"    {k}={_py(v)}," for k, v in args.items()]
    return "\n".join([f"{target}(", *lines, ")"])


def _recompute_comment(plan: Plan) -> list[str]:
    if not plan.checkpointing:
        return []
    return ["the plan checkpoints activations: gradaccum.enable_checkpointing(model) first"]


def _launch_comment(plan: Plan, command: str) -> list[str]:
    if plan.world_size == 1:
        return []
    return [f"launch {plan.world_size} processes: {command}"]


def _transformers(plan: Plan, micro_size: int, steps: int):
    settings: dict[str, Any] = {
        "per_device_train_batch_size": micro_size,
        "gradient_accumulation_steps": steps,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
    }
    if plan.checkpointing:
        settings["gradient_checkpointing"] = True
    comments = [
        *_launch_comment(plan, f"torchrun --nproc-per-node {plan.world_size} train.py"),
        "exact over tokens and ranks: gradaccum.integrations.transformers.Trainer",
    ]
    snippet = "from transformers import TrainingArguments\n\nargs = " + _call(
        "TrainingArguments", settings, first={"output_dir": "out"}
    )
    return settings, comments, snippet


def _lightning(plan: Plan, micro_size: int, steps: int):
    settings = {
        "accumulate_grad_batches": steps,
        "precision": _LIGHTNING_PRECISION[plan.precision],
        "devices": plan.world_size,  # on several nodes: devices x num_nodes ranks
    }
    comments = [
        *_recompute_comment(plan),
        "Lightning divides each micro-batch's loss by accumulate_grad_batches; exact over "
        "tokens and ranks: gradaccum.integrations.lightning.ExactAccumulation",
    ]
    snippet = "\n".join(
        [
            "import lightning as L",
            "from torch.utils.data import DataLoader",
            "",
            f"train_loader = DataLoader(train_dataset, batch_size={micro_size}, shuffle=True)",
            "trainer = " + _call("L.Trainer", settings),
        ]
    )
    return settings, comments, snippet


def _accelerate(plan: Plan, micro_size: int, steps: int):
    settings = {
        "gradient_accumulation_steps": steps,
        "mixed_precision": _ACCELERATE_PRECISION[plan.precision],
    }
    comments = [
        *_launch_comment(plan, f"accelerate launch --num_processes {plan.world_size} train.py"),
        *_recompute_comment(plan),
        "accelerator.backward divides each micro-batch's loss by gradient_accumulation_steps",
    ]
    snippet = "\n".join(
        [
            "from accelerate import Accelerator",
            "from torch.utils.data import DataLoader",
            "",
            "accelerator = " + _call("Accelerator", settings),
            f"train_loader = DataLoader(train_dataset, batch_size={micro_size}, shuffle=True)",
        ]
    )
    return settings, comments, snippet


def _deepspeed(plan: Plan, micro_size: int, steps: int):
    config: dict[str, Any] = {
        "train_batch_size": plan.effective_batch,
        "train_micro_batch_size_per_gpu": micro_size,
        "gradient_accumulation_steps": steps,
    }
    comments = _launch_comment(plan, f"deepspeed --num_gpus {plan.world_size} train.py")
    if plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    if plan.precision != "fp32":
        # DeepSpeed casts the model to bf16/fp16, so its gradients accumulate in that dtype
        # unless told otherwise; it accumulates in fp32 only under ZeRO, and
        # deepspeed.initialize refuses the mix without it ("unsupported mix of model_dtype").
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["zero_optimization"] = {"stage": 1}
        comments.append("fp32 gradient accumulation (grad_accum_dtype) needs ZeRO: stage 1 or up")
    if getattr(plan, "zero_stage", 0) == 3:
        config["zero_optimization"] = {"stage": 3}
        comments.append("the model sharded over the ranks, as estimated: ZeRO stage 3")
    comments += _recompute_comment(plan)
    return config, comments, json.dumps(config, indent=2)
