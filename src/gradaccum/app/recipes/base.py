"""What every recipe is (``Recipe``), the data it trains on (``TaskData``), and the pieces
the recipes share: the seeded epoch order and a language model's held-out loss. A leaf of the
recipes package: the recipes import it, the registry (recipes/__init__.py) re-exports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradaccum.batching import split
from gradaccum.loss import causal_lm_loss

__all__ = ["Recipe", "TaskData", "epoch_order", "held_out_loss"]


class TaskData(Protocol):
    def batch(self, position: int, size: int) -> Any:
        """Samples ``position`` to ``position + size`` of the stream (``position`` = samples
        read so far), or fewer at the end of an epoch: a ragged last window."""

    def epoch_samples(self) -> int:
        """Samples in one pass over the training data."""

    def evaluate(
        self, model: torch.nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        """Held-out metrics; ``loss`` at least. ``limit``: the first ``limit`` held-out
        samples alone (the planner measures evaluation's memory on a few micro-batches)."""

    # Optionally, ``baseline(model, micro_size) -> {"name": ..., metric: value}``: what the
    # untrained model scores by a simpler method (a linear probe), measured before training,
    # for the summary to set the run's result against.


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    build_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, Any]]
    sample_batch: Callable[[int], Any]  # n samples at their largest shape
    make_data: Callable[[int], TaskData]  # seed -> data
    signature: dict[str, Any]  # what a checkpoint must match
    # A language model's text side, for --data: its tokenizer (built on demand) and how to
    # get logits from token ids. None for a recipe that does not read text.
    encoder: Callable[[], Any] | None = None
    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None
    metrics: tuple[str, ...] = ("loss",)  # what its held-out evaluation measures
    # The held-out evaluation's arithmetic over a batch of the sample's form: (model, batch,
    # micro_size) -> metrics, what its data's evaluate runs on the held-out set; the plan's
    # fresh process runs it on the sample (its data's evaluate when None). A language
    # model's is held_out_loss with its logits.
    evaluate: Callable[[torch.nn.Module, Any, int], dict[str, float]] | None = None
    item: str = "item"  # what its loss averages over: the unit of the loss and of the rate
    # `gradaccum train`'s defaults for this recipe where they differ from TrainConfig's (a
    # larger effective batch, its own budget and length); flags and config files override.
    defaults: dict[str, Any] = field(default_factory=dict)


def epoch_order(n: int, seed: int, position: int, size: int) -> torch.Tensor:
    """Indices of samples ``position`` to ``position + size`` of a stream that visits ``n``
    samples once per epoch, each epoch in a fresh seeded order; cut at the epoch's end (a
    ragged last window)."""
    epoch, offset = divmod(position, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[offset : min(offset + size, n)]


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module,
    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    labels: torch.Tensor,
    micro_size: int,
) -> dict[str, float]:
    """``{"loss": next-token loss per counted token}`` over held-out sequences, in eval mode,
    in micro-batches moved to the model's device; ``{}`` when no token counts."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in zip(split(ids, micro_size), split(labels, micro_size), strict=True):
        loss_sum, n = causal_lm_loss(logits(model, x.to(device)), y.to(device))
        total += float(loss_sum)
        count += int(n)
    model.train(was_training)
    return {"loss": total / count} if count else {}
