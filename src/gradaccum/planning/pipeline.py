"""A pipeline's planning: how many micro-batches an effective batch streams through its
stages in (``plan_micro_batches``), from each stage's memory counted in tensors
(``measure_stage``). The window through the stages is gradaccum.pipeline's
``PipelineWindow``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradaccum.memory import format_bytes, saved_activation_bytes
from gradaccum.pipeline import SCHEDULES

__all__ = ["PipelinePlan", "measure_stage", "plan_micro_batches"]


@dataclass(frozen=True)
class PipelinePlan:
    """The number of micro-batches ``m`` for an effective batch ``B`` through ``stages``
    stages: micro-batches of ``B / m``; ``bubble`` = (p - 1) / (m + p - 1); ``predicted``:
    the fullest stage's peak (its parameters, gradients and optimizer state, plus the
    activations of the micro-batches it holds at once: m under GPipe, min(m, p) under
    1F1B); ``why``: how m was chosen; ``table``: every candidate m."""

    micro_batches: int
    micro_size: int
    stages: int
    schedule: str
    bubble: float
    predicted: float
    budget: int
    static_bytes: int
    activation_bytes_per_sample: float
    why: str
    table: tuple[tuple[int, float, float, bool], ...]  # (m, bubble, predicted, fits)

    def summary(self) -> str:
        lines = [
            f"pipeline plan: {self.micro_batches} micro-batches of {self.micro_size} through "
            f"{self.stages} stages ({self.schedule}): bubble {self.bubble:.0%}, fullest stage "
            f"{format_bytes(self.predicted)} of {format_bytes(self.budget)}; {self.why}",
            "      m   bubble   fullest stage",
        ]
        for m, bubble, predicted, fits in self.table:
            mark = "  <-" if m == self.micro_batches else ("" if fits else "  over budget")
            lines.append(f"  {m:>5}   {bubble:>6.0%}   {format_bytes(predicted):>13}{mark}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_micro_batches(
    effective_batch: int,
    stages: int,
    schedule: str,
    static_bytes: int,
    activation_bytes_per_sample: float,
    budget: int,
    *,
    margin: float = 0.15,
    max_bubble: float = 0.2,
) -> PipelinePlan:
    """Choose m among the divisors of ``effective_batch`` (equal micro-batches: a schedule
    runs one shape). The fewest micro-batches whose bubble is at most ``max_bubble`` and
    whose fullest stage fits ``budget`` less ``margin``: fewer, larger micro-batches waste
    less per micro-batch (each is a send, a receive and smaller kernels); if none of those
    fits, the fewest that fits; if none fits, a ValueError saying what would.

    ``static_bytes`` and ``activation_bytes_per_sample`` are the largest over the stages
    (``measure_stage``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    usable = budget * (1 - margin)
    table = []
    for m in (d for d in range(1, effective_batch + 1) if effective_batch % d == 0):
        held = m if schedule == "gpipe" else min(m, stages)
        predicted = static_bytes + held * (effective_batch // m) * activation_bytes_per_sample
        bubble = (stages - 1) / (m + stages - 1)
        table.append((m, bubble, predicted, predicted <= usable))
    fitting = [row for row in table if row[3]]
    if not fitting:
        smallest = min(row[2] for row in table)
        raise ValueError(
            f"no number of micro-batches fits {format_bytes(budget)} (less a {margin:.0%} "
            f"margin) on every stage: the fullest stage needs at least "
            f"{format_bytes(smallest)}"
            + (
                "; GPipe holds every micro-batch's activations at once, 1F1B only "
                f"{stages}: try schedule='1f1b'"
                if schedule == "gpipe"
                else ""
            )
            + "; give a larger budget or use more stages"
        )
    short = [row for row in fitting if row[1] <= max_bubble + 1e-12]
    if short:
        chosen = short[0]
        why = f"the fewest micro-batches with a bubble at most {max_bubble:.0%} that fit"
    else:
        chosen = fitting[-1]
        why = (
            f"no division of {effective_batch} gives a bubble of at most {max_bubble:.0%} "
            "within the budget: the most micro-batches that fit"
        )
    m = chosen[0]
    return PipelinePlan(
        micro_batches=m,
        micro_size=effective_batch // m,
        stages=stages,
        schedule=schedule,
        bubble=chosen[1],
        predicted=chosen[2],
        budget=budget,
        static_bytes=static_bytes,
        activation_bytes_per_sample=activation_bytes_per_sample,
        why=why,
        table=tuple(table),
    )


def measure_stage(
    module: torch.nn.Module,
    sample_input: Callable[[int], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    optimizer_slots: int = 2,
) -> tuple[int, float]:
    """One stage's memory, counted in tensors: ``static`` = its trainable parameters with
    their gradients and ``optimizer_slots`` states each (AdamW: 2); activations per sample:
    what autograd saves in a forward of 2 samples and 4, the difference per sample (the
    input a stage receives, which it keeps for its backward, included)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    static = sum(p.numel() * p.element_size() for p in trainable) * (2 + optimizer_slots)
    saved = []
    for n in (2, 4):
        x = sample_input(n)
        if x.is_floating_point():
            x.requires_grad_(True)
        with saved_activation_bytes(module) as total:
            loss = loss_fn(module(x))
        loss.backward()
        module.zero_grad(set_to_none=True)
        saved.append(total[0] + (x.numel() * x.element_size() if x.is_floating_point() else 0))
    return static, max(0.0, (saved[1] - saved[0]) / 2)
