"""Contrastive fine-tuning with in-batch negatives: all-MiniLM-L6-v2 learns to find, for a
docstring paragraph of the Python standard library, the next paragraph of the same module
among every other paragraph of the batch.

The data: the docstring paragraphs of every standard library module outside its tests, as
pairs of consecutive paragraphs of one module (query, positive), a tenth of the modules
held out whole. The loss: multiple-negatives
ranking (sentence-transformers' MultipleNegativesRankingLoss, scale 20): each query's
positive against every other positive of the batch, which are its negatives. A batch of
1,024 pairs gives each query 1,023 negatives; accumulated naively over micro-batches of 64,
each query would see only 63. ``ga.InBatch`` (cached gradients) makes the window's gradient
the whole batch's. Evaluation: held-out pairs, each query's positive retrieved among every
held-out positive (accuracy at 1) and the ranking loss over the whole held-out set.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.app.recipes import minilm
from gradaccum.batching import split
from gradaccum.inbatch import InBatch

SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss scale (1 / temperature)


class PairEncoder(nn.Module):
    """The pretrained encoder and mean pooling: a paragraph's embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = minilm.pretrained_encoder()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return minilm.mean_pooled(self.encoder, input_ids, attention_mask)


def embed(model: nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return model(mb["query_ids"], mb["query_mask"]), model(mb["doc_ids"], mb["doc_mask"])


def ranking_loss(parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Each query's positive (same row) against every positive of the batch, summed over
    queries; the count is the queries."""
    query, doc = parts
    scores = SCALE * F.normalize(query, dim=-1) @ F.normalize(doc, dim=-1).T
    target = torch.arange(len(query), device=scores.device)
    return F.cross_entropy(scores.float(), target, reduction="sum"), len(query)


LOSS = InBatch(embed, ranking_loss)


HELD_OUT = 0.1  # of the modules, whole


@functools.cache
def pairs(split_name: str) -> list[tuple[str, str]]:
    """Pairs of consecutive docstring paragraphs of one module, each paragraph in one pair
    at most (chained pairs would make a query another pair's positive), from every module
    of the standard library outside its tests; a seeded HELD_OUT of the modules held out
    whole (``split_name``: "train" or "held_out")."""
    from gradaccum.app.recipes.stdlib_text import stdlib_dir

    root = stdlib_dir()
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in ("test", "tests", "idle_test", "site-packages") for p in parts):
            continue
        docs = minilm._paragraphs(path)
        if len(docs) >= 2:
            modules.append([(docs[i], docs[i + 1]) for i in range(0, len(docs) - 1, 2)])
    order = torch.randperm(len(modules), generator=torch.Generator().manual_seed(0)).tolist()
    held = set(order[: max(1, round(HELD_OUT * len(modules)))])
    held_out = [pair for i, found in enumerate(modules) if i in held for pair in found]
    if split_name == "held_out":
        return held_out
    # Some modules share docstrings with others (vendored copies, pure-Python twins of C
    # modules): a held-out pair is never trained on.
    seen = set(held_out)
    return [
        pair
        for i, found in enumerate(modules)
        if i not in held
        for pair in found
        if pair not in seen
    ]


def _encoded(chosen: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    query_ids, query_mask = minilm.encode([q for q, _ in chosen])
    doc_ids, doc_mask = minilm.encode([d for _, d in chosen])
    return {
        "query_ids": query_ids,
        "query_mask": query_mask,
        "doc_ids": doc_ids,
        "doc_mask": doc_mask,
    }


class PairData:
    """The training pairs in a fresh seeded order each epoch; held-out retrieval."""

    def __init__(self, seed: int) -> None:
        from gradaccum.app.recipes.base import epoch_order

        self._order = epoch_order
        self.seed = seed
        self.train = _encoded(pairs("train"))
        self.held_out = _encoded(pairs("held_out"))

    def epoch_samples(self) -> int:
        return len(self.train["query_ids"])

    def batch(self, position: int, size: int) -> dict[str, torch.Tensor]:
        chosen = self._order(self.epoch_samples(), self.seed, position, size)
        return {k: v[chosen] for k, v in self.train.items()}

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        """Each held-out query's positive among every held-out positive: accuracy at 1 and
        the ranking loss over the whole held-out set (or its first ``limit`` pairs)."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        held = {k: v[:limit].to(device) for k, v in self.held_out.items()}
        parts = [embed(model, mb) for mb in split(held, max(1, micro_size))]
        query = torch.cat([q for q, _ in parts])
        doc = torch.cat([d for _, d in parts])
        model.train(was_training)
        loss_sum, n = ranking_loss((query, doc))
        scores = F.normalize(query, dim=-1) @ F.normalize(doc, dim=-1).T
        hits = int((scores.argmax(1) == torch.arange(n, device=scores.device)).sum())
        return {"loss": float(loss_sum) / n, "accuracy": hits / n}


def sample_batch(n: int) -> dict[str, torch.Tensor]:
    """``n`` pairs at the longest shape: every one of the MAX_TOKENS positions real."""
    full = minilm.sample_batch(n)
    ids, mask = full["input_ids"], full["attention_mask"]
    return {"query_ids": ids, "query_mask": mask, "doc_ids": ids.clone(), "doc_mask": mask.clone()}


# What `gradaccum train --recipe minilm-pairs` runs with unless told otherwise: 1,024 pairs
# per step, each query against 1,023 negatives, under a budget in which a micro-batch of at
# most 64 pairs fits.
DEFAULTS: dict[str, Any] = {
    "effective_batch": 1024,
    "budget": "2GB",
    "steps": 8,
    "lr": 2e-5,
    "warmup_steps": 1,
    "eval_every": 2,
    "checkpoint_every": 4,
}
