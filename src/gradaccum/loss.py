"""The (loss_sum, count) contract and helpers that follow it.

A loss function for the Accumulator returns the loss *summed* over the items a micro-batch
covers and how many items that is. The Accumulator backpropagates the sum and divides the
window's gradient once by the window's total count, which is the gradient of a mean loss
over the whole large batch. Returning a per-micro-batch mean instead weights a micro-batch
with few items (short sequences, mostly padding) as much as one with many: that is the
bug this contract exists to remove.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["token_cross_entropy", "causal_lm_loss", "sample_mean"]


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the tokens whose label is not ``ignore_index``.

    ``logits``: (..., vocab); ``labels``: the same leading shape. Returns ``(loss_sum, count)``
    with ``count`` the number of labels that are not ignored, as a 0-dim int64 tensor (no
    host sync). No label shift is applied; see :func:`causal_lm_loss` for next-token loss.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., vocab), got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match logits shape "
            f"{tuple(logits.shape)} without its last (vocab) dimension"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_logits.dtype in (torch.float16, torch.bfloat16):
        flat_logits = flat_logits.float()  # a long sum of low-precision terms loses bits
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    count = (flat_labels != ignore_index).sum()
    return loss_sum, count


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy for a causal LM: position t predicts label t+1.

    ``logits``: (batch, seq, vocab); ``labels``: (batch, seq), usually the input ids with
    padding set to ``ignore_index``. The shift drops the last logit and the first label, and
    ``count`` is the number of *shifted* labels that are not ignored; counting before the
    shift over-counts by one per sequence.
    """
    if logits.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            "causal_lm_loss expects logits (batch, seq, vocab) and labels (batch, seq), got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return token_cross_entropy(logits[:, :-1, :], labels[:, 1:], ignore_index=ignore_index)


def sample_mean(losses: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum, count)`` for a loss that is a mean over samples.

    ``losses`` is an unreduced loss (``reduction="none"``) with the samples on dim 0; any
    further dimensions are averaged within each sample first, so an elementwise MSE of shape
    (batch, features) gives the same mean as ``F.mse_loss(..., reduction="mean")`` over the
    full batch. ``count`` is the number of samples.
    """
    if losses.dim() == 0:
        raise ValueError(
            "sample_mean needs unreduced per-sample losses with samples on dim 0, got a 0-dim "
            "tensor; call the loss with reduction='none'"
        )
    if losses.shape[0] == 0:
        return losses.sum(), 0
    per_sample = losses.reshape(losses.shape[0], -1).mean(dim=1)
    return per_sample.sum(), losses.shape[0]
