"""The (loss_sum, count) contract: its checks, and loss helpers that follow it.

A loss function for the Accumulator returns the loss *summed* over the items a micro-batch
covers and how many items that is. The Accumulator backpropagates the sum and divides the
window's gradient once by the window's total count, which is the gradient of a mean loss
over the whole large batch. Returning a per-micro-batch mean instead weights a micro-batch
with few items (short sequences, mostly padding) as much as one with many: that is the
bug this contract exists to remove.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "causal_lm_loss",
    "check_count",
    "check_loss",
    "count_value",
    "sample_mean",
    "tensor_count_total",
    "token_cross_entropy",
    "unpack",
    "window_input",
]


# -- the contract, checked on every micro-batch ------------------------------------------------


def window_input(micro_batches: Any, loss_fn: Any, may_be_empty: bool = False) -> list[Any]:
    """``step()``'s arguments checked: a sequence of micro-batches (as a list) and a callable.
    ``may_be_empty``: a data-parallel rank may hold none (it is padded: ``Sync.pad``)."""
    if isinstance(micro_batches, (torch.Tensor, Mapping)):
        raise TypeError(
            f"step() takes a sequence of micro-batches, got a {type(micro_batches).__name__};"
            " split a batch first with ga.split(batch, micro_size)"
        )
    if isinstance(micro_batches, tuple) and all(isinstance(t, torch.Tensor) for t in micro_batches):
        raise TypeError(
            f"step() got a tuple of {len(micro_batches)} tensors: a batch such as (inputs, "
            "labels)? Split it first with ga.split(batch, micro_size); a window whose "
            "micro-batches are single tensors goes in a list"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    given = list(micro_batches)
    if not given and not may_be_empty:
        raise ValueError("step() got an empty window: a window needs at least one micro-batch")
    return given


def unpack(result: Any, index: int) -> tuple[Any, Any]:
    """``loss_fn``'s return value as ``(loss_sum, count)``, or the TypeError saying what it was."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = f"a {type(result).__name__}"
        if isinstance(result, (tuple, list)):
            got += f" of length {len(result)}"
        raise TypeError(
            f"loss_fn must return (loss_sum, count), got {got} from micro-batch {index}; return "
            "the loss summed over the micro-batch's items and the number of items, e.g. "
            "ga.sample_mean(F.mse_loss(pred, y, reduction='none'))"
        )
    return result[0], result[1]


def check_loss(loss_sum: Any, index: int) -> torch.Tensor:
    """A 0-dim floating tensor that requires grad, or the error naming what it is instead."""
    where = f"from micro-batch {index}"
    if not isinstance(loss_sum, torch.Tensor):
        raise TypeError(f"loss_sum must be a 0-dim tensor, got {type(loss_sum).__name__} {where}")
    if loss_sum.dim() != 0:
        raise ValueError(
            f"loss_sum must be a 0-dim tensor (the loss summed over the micro-batch's items), got "
            f"shape {tuple(loss_sum.shape)} {where}; reduce it with .sum() or ga.sample_mean"
        )
    if not loss_sum.is_floating_point():
        raise TypeError(f"loss_sum must be a floating-point tensor, got {loss_sum.dtype} {where}")
    if not loss_sum.requires_grad:
        raise ValueError(
            f"loss_sum {where} does not require grad: was it computed under torch.no_grad(), "
            "detached, or from a model with no trainable parameters?"
        )
    return loss_sum


def check_count(count: Any, index: int) -> int | torch.Tensor:
    """A count as a Python int, checked now; or, for a count on an accelerator, a 0-dim tensor
    whose value :func:`count_value` checks at the window's end (one host sync per window, not
    one per micro-batch)."""
    where = f"from micro-batch {index}"
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"count must be an integer or a 0-dim tensor, got a tensor of shape "
                f"{tuple(count.shape)} {where}"
            )
        if count.is_complex() or count.dtype == torch.bool:
            raise ValueError(
                f"count must be a real number of items, got dtype {count.dtype} {where}"
            )
        if not count.is_cpu:
            return count.detach().reshape(())
        return count_value(count.item(), index)
    if isinstance(count, bool) or not isinstance(count, numbers.Real):  # numpy's too
        raise ValueError(f"count must be a non-negative integer, got {count!r} {where}")
    return count_value(count, index)


def count_value(value: float, index: int) -> int:
    """A count read as a number: a whole, non-negative number of items, or the error naming it."""
    if value < 0 or not float(value).is_integer():
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ValueError(
            f"count must be a non-negative integer, got {shown} from micro-batch {index}"
        )
    return int(value)


def tensor_count_total(counts: list[tuple[int, torch.Tensor]]) -> int:
    """The sum of counts left on an accelerator, given as ``(micro-batch index, count)``: read
    with one host sync, each checked as :func:`count_value` checks a number."""
    if not counts:
        return 0
    values = torch.stack([c.to(torch.float64) for _, c in counts]).cpu().tolist()
    return sum(count_value(v, i) for (i, _), v in zip(counts, values, strict=True))


# -- loss helpers -------------------------------------------------------------------------------


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
