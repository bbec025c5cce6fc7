"""A loss of three terms with three denominators, and its full-batch reference in torch alone.

The terms, on a padded language-model batch (``helpers.padded_lm_batch``):
- ``ce``: next-token cross-entropy, a mean over the window's counted tokens;
- ``seq``: the same per-token losses, a mean within each sequence, then over sequences
  (weight 0.5);
- ``z``: the squared log-partition (a "z-loss") over "routed" tokens, those whose next
  input id is even, a mean over the routed tokens (weight 0.01).

``reference`` computes the whole batch's loss with torch's own ops and no gradaccum;
``loss_fn`` and ``counts`` are the same loss for ``Accumulator.step(..., counts=counts)``;
``naive_loss`` is what a per-micro-batch mean does: each micro-batch's three means, averaged
over the micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gradaccum as ga

WEIGHTS = {"ce": 1.0, "seq": 0.5, "z": 0.01}


def _parts(model, batch):
    """Per-token CE losses, their mask, the z-loss per token and the routed mask, shifted."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1).clamp(min=0),
        reduction="none",
    ).reshape(labels.shape)
    z = torch.logsumexp(logits, dim=-1).square()
    routed = mask & (batch["input_ids"][:, 1:] % 2 == 0)
    return ce, mask, z, routed


def reference_terms(model, batch) -> dict[str, torch.Tensor]:
    """Each term's mean over the whole batch, torch alone."""
    ce, mask, z, routed = _parts(model, batch)
    rows = mask.any(dim=1)
    per_row = (ce * mask).sum(dim=1)[rows] / mask.sum(dim=1)[rows]
    return {
        "ce": ce[mask].mean(),
        "seq": per_row.mean(),
        "z": z[routed].mean(),
    }


def reference(model, batch) -> torch.Tensor:
    return sum(WEIGHTS[k] * v for k, v in reference_terms(model, batch).items())


def naive_loss(model, micro_batches) -> torch.Tensor:
    """The bug: each micro-batch's means, averaged over micro-batches."""
    return sum(reference(model, mb) for mb in micro_batches) / len(micro_batches)


def loss_fn(model, mb):
    ce, mask, z, routed = _parts(model, mb)
    return {
        "ce": ga.per_token(ce, mask),
        "seq": (*ga.per_sequence(ce, mask), WEIGHTS["seq"]),
        "z": (*ga.per_token(z, routed), WEIGHTS["z"]),
    }


def counts(mb):
    mask = mb["labels"][:, 1:] != -100
    routed = mask & (mb["input_ids"][:, 1:] % 2 == 0)
    return {"ce": ga.token_count(mask), "seq": ga.sequence_count(mask), "z": ga.token_count(routed)}
