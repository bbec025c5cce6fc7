"""The (loss_sum, count) contract: its checks, and loss helpers that follow it.

A loss function for the Accumulator returns the loss *summed* over the items a micro-batch
covers and how many items that is. The Accumulator backpropagates the sum and divides the
window's gradient once by the window's total count, which is the gradient of a mean loss
over the whole large batch. Returning a per-micro-batch mean instead weights a micro-batch
with few items (short sequences, mostly padding) as much as one with many: that is the
bug this contract exists to remove.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "MicroBatchLoss",
    "WindowLoss",
    "causal_lm_loss",
    "constant_normalizer",
    "group_count",
    "load_balancing",
    "next_token_labels",
    "per_group",
    "per_sequence",
    "per_token",
    "routing_counts",
    "sequence_count",
    "sequence_ids",
    "token_count",
    "check_count",
    "check_loss",
    "count_value",
    "sample_mean",
    "tensor_count_total",
    "token_cross_entropy",
    "unpack",
    "window_input",
    "window_loss",
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
    """``loss_fn``'s return value as ``(loss_sum, count)``, or named terms as ``(terms, None)``
    (a mapping, checked term by term as the window records it), or the TypeError saying what
    it was."""
    if isinstance(result, Mapping):
        return result, None
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


def window_counts(counts: Any, micro_batches: list[Any]) -> dict[str, Any]:
    """``counts(micro_batch)`` summed over a window's micro-batches, term by term."""
    total: dict[str, Any] = {}
    for index, micro_batch in enumerate(micro_batches):
        given = counts(micro_batch)
        if not isinstance(given, Mapping):
            raise TypeError(
                f"counts must return a mapping of each term's name to its count, got a "
                f"{type(given).__name__} for micro-batch {index}"
            )
        for name, n in given.items():
            n = check_term_count(n, name, index)
            n = n.item() if isinstance(n, torch.Tensor) else n
            total[str(name)] = total.get(str(name), 0) + n
    return total


def zero_loss(loss: Any, index: int) -> tuple[Any, Any]:
    """A padding micro-batch's loss (``Sync.pad``): the same graph, times zero, no item."""
    if isinstance(loss, Mapping):
        zeroed = {}
        for name, term in loss.items():
            loss_sum, _, weight = unpack_term(term, str(name), index)
            zeroed[name] = (loss_sum * 0.0, 0, weight)
        return zeroed, None
    return check_loss(loss, index) * 0.0, 0


class WindowLoss:
    """A loss that runs a whole window itself, through the Accumulator's public manual API
    (``begin_window``, ``micro_batch``, ``backward``): ``acc.step(micro_batches, loss)``
    calls ``run``. A plain ``loss_fn(model, micro_batch)`` runs as ``MicroBatchLoss``; a
    loss over the whole window's embeddings (``ga.InBatch``) is one of its own."""

    def run(self, acc: Any, micro_batches: list[Any], real: int) -> None:
        """Forward and backward of one window's ``micro_batches`` through ``acc``; those from
        ``real`` on pad this rank to the others' number (``Sync.pad``) and count zero."""
        raise NotImplementedError


class MicroBatchLoss(WindowLoss):
    """``loss_fn(model, micro_batch) -> (loss_sum, count)`` (or named terms, each counted by
    ``counts(micro_batch)`` before the window's first backward), one micro-batch at a time."""

    def __init__(self, loss_fn: Any, counts: Any = None) -> None:
        if counts is not None and not callable(counts):
            raise TypeError(
                f"counts must be a function of a micro-batch returning each term's count, got "
                f"{type(counts).__name__}"
            )
        self.loss_fn, self.counts = loss_fn, counts

    def run(self, acc: Any, micro_batches: list[Any], real: int) -> None:
        if self.counts is not None:
            # A rank that holds no micro-batch (padded) still names every term, with 0 items.
            held = micro_batches[:real] if real else micro_batches[:1]
            counted = window_counts(self.counts, held)
            acc.begin_window({k: n if real else 0 for k, n in counted.items()})
        for index, micro_batch in enumerate(micro_batches):
            with acc.micro_batch(last=index == len(micro_batches) - 1):
                loss_sum, count = unpack(self.loss_fn(acc.model, micro_batch), index)
                if index >= real:
                    loss_sum, count = zero_loss(loss_sum, index)
                acc.backward(loss_sum, count)


def window_loss(loss_fn: Any, counts: Any = None) -> WindowLoss:
    """``step()``'s loss as the ``WindowLoss`` that runs its window."""
    if not isinstance(loss_fn, WindowLoss):
        return MicroBatchLoss(loss_fn, counts)
    if counts is not None:
        raise TypeError(
            f"counts= is for named terms; a {type(loss_fn).__name__} loss counts its own items"
        )
    return loss_fn


def unpack_term(value: Any, name: str, index: int) -> tuple[torch.Tensor, Any, float]:
    """One named term of a micro-batch's loss: ``(loss_sum, count)`` or ``(loss_sum, count,
    weight)``, checked; returns ``(loss_sum, count, weight)`` (weight 1 when not given). A
    term that holds no item in this micro-batch (count 0) may be a constant."""
    where = f"term {name!r} from micro-batch {index}"
    if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
        got = f"a {type(value).__name__}"
        if isinstance(value, (tuple, list)):
            got += f" of length {len(value)}"
        raise TypeError(
            f"{where} must be (loss_sum, count) or (loss_sum, count, weight), got {got}"
        )
    loss_sum, count = value[0], check_term_count(value[1], name, index)
    weight = value[2] if len(value) == 3 else 1.0
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
    ):
        raise ValueError(f"{where}: weight must be a finite number, got {weight!r}")
    if isinstance(loss_sum, torch.Tensor) and not loss_sum.requires_grad and count == 0:
        if loss_sum.dim() != 0 or not loss_sum.is_floating_point():
            raise ValueError(f"{where}: loss_sum must be a 0-dim floating tensor")
        return loss_sum, count, float(weight)
    try:
        loss_sum = check_loss(loss_sum, index)
    except (TypeError, ValueError) as e:
        raise type(e)(f"term {name!r}: {e}") from None
    return loss_sum, count, float(weight)


def check_term_count(count: Any, name: Any, index: int | None = None) -> Any:
    """A named term's count: a non-negative finite number (a term's normalizer may be a
    fraction: one group's share per completion), or a 0-dim tensor on an accelerator, read at
    the window's end. ``index`` None: the window's count given before its first backward."""
    where = f"term {name!r}" + ("" if index is None else f" from micro-batch {index}")
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.is_complex() or count.dtype == torch.bool:
            raise ValueError(
                f"{where}: count must be a number or a 0-dim real tensor, got a "
                f"{count.dtype} tensor of shape {tuple(count.shape)}"
            )
        if not count.is_cpu and index is not None:
            return count.detach().reshape(())
        count = count.item()
    if isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise ValueError(f"{where}: count must be a non-negative number, got {count!r}")
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"{where}: count must be a non-negative number, got {count:g}")
    return int(count) if float(count).is_integer() else float(count)


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
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the tokens whose label is not ``ignore_index``.

    ``logits``: (..., vocab); ``labels``: the same leading shape. Returns ``(loss_sum, count)``
    with ``count`` the number of labels that are not ignored, as a 0-dim int64 tensor (no
    host sync). No label shift is applied; see :func:`causal_lm_loss` for next-token loss.
    ``label_smoothing``: as ``F.cross_entropy``'s (and transformers' ``LabelSmoother``).
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
    loss_sum = F.cross_entropy(
        flat_logits,
        flat_labels,
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    count = (flat_labels != ignore_index).sum()
    return loss_sum, count


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    position_ids: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy for a causal LM: position t predicts label t+1.

    ``logits``: (batch, seq, vocab); ``labels``: (batch, seq), usually the input ids with
    padding set to ``ignore_index``. The shift drops the last logit and the first label, and
    ``count`` is the number of *shifted* labels that are not ignored; counting before the
    shift over-counts by one per sequence.

    ``position_ids``: for packed rows (several sequences per row, each starting at position
    0): the last token of one sequence does not predict the first of the next, so those
    labels are not counted either; a packed row of N sequences counts what the N sequences
    count unpacked.
    """
    if logits.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            "causal_lm_loss expects logits (batch, seq, vocab) and labels (batch, seq), got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return token_cross_entropy(
        logits[:, :-1, :],
        next_token_labels(labels, ignore_index, position_ids),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )


def next_token_labels(
    labels: torch.Tensor, ignore_index: int = -100, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``labels[:, 1:]``, each the target of the position before it; in packed rows
    (``position_ids``), a target that starts a new sequence is ``ignore_index``."""
    shifted = labels[:, 1:]
    if position_ids is None:
        return shifted
    if position_ids.shape != labels.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} does not match labels shape "
            f"{tuple(labels.shape)}"
        )
    return shifted.masked_fill(position_ids[:, 1:] == 0, ignore_index)


# -- normalizations: each returns one term, (loss_sum, count) -----------------------------------
#
# A per-token loss tensor ``losses`` (batch, seq) and its ``mask`` (1 where a token counts) make
# a term of the window's loss; the window divides it by its count over the window and the
# ranks. Each normalization has a count function of the mask alone, for step(counts=...): the
# term's counts are then known before the window's first backward.


def _mask(losses: torch.Tensor, mask: torch.Tensor | None, name: str) -> torch.Tensor:
    if losses.dim() != 2:
        raise ValueError(f"{name} expects losses (batch, seq), got shape {tuple(losses.shape)}")
    if mask is None:
        return torch.ones_like(losses, dtype=torch.bool)
    if mask.shape != losses.shape:
        raise ValueError(
            f"{name}: mask shape {tuple(mask.shape)} does not match losses shape "
            f"{tuple(losses.shape)}"
        )
    return mask.bool()


def token_count(mask: torch.Tensor) -> torch.Tensor:
    """The tokens that count: ``per_token``'s count."""
    return mask.bool().sum()


def per_token(
    losses: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every counted token of the window weighs the same: the sum over tokens / the window's
    token count (DAPO's token-level loss, TRL's ``loss_type="dapo"``; ``"bnpo"`` is the same
    over one micro-batch only, which accumulation must not do)."""
    mask = _mask(losses, mask, "per_token")
    return torch.where(mask, losses, 0).sum(), token_count(mask)


def sequence_ids(
    mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which sequence each token belongs to, numbered from 0 in the micro-batch, -1 where
    ``mask`` is 0: one sequence per row; in packed rows, a new one wherever ``position_ids``
    is 0, or at each of ``cu_seqlens`` (the cumulative lengths over the flattened rows, as
    flash attention's varlen kernels take them, starting with 0)."""
    mask = mask.bool()
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("give position_ids or cu_seqlens, not both")
    if position_ids is not None:
        if position_ids.shape != mask.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} does not match the mask's "
                f"{tuple(mask.shape)}"
            )
        starts = position_ids == 0
        starts[:, 0] = True  # a row always starts a sequence
    elif cu_seqlens is not None:
        bounds = cu_seqlens.long().flatten()
        if (
            bounds.numel() < 2
            or bounds[0] != 0
            or bounds[-1] != mask.numel()
            or (bounds.diff() < 0).any()
        ):
            raise ValueError(
                f"cu_seqlens must rise from 0 to the number of tokens ({mask.numel()}), got "
                f"{bounds.tolist()}"
            )
        starts = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        starts[bounds[:-1][bounds.diff() > 0]] = True
        starts = starts.reshape(mask.shape)
        starts[:, 0] = True
    else:
        starts = torch.zeros_like(mask)
        starts[:, 0] = True
    ids = starts.flatten().long().cumsum(0).reshape(mask.shape) - 1
    return torch.where(mask, ids, -1)


_sequence_ids = sequence_ids  # for the helpers whose argument of that name shadows it


def _per_sequence_means(
    losses: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's mean over its counted tokens, and which sequences have any."""
    n = int(ids.max()) + 1 if ids.numel() else 0
    flat = ids.flatten()
    keep = flat >= 0
    sums = losses.new_zeros(max(n, 0)).index_add(0, flat[keep], losses.flatten()[keep])
    tokens = torch.zeros(max(n, 0), dtype=losses.dtype, device=losses.device)
    tokens = tokens.index_add(0, flat[keep], torch.ones_like(losses.flatten()[keep]))
    present = tokens > 0
    return sums[present] / tokens[present], present


def sequence_count(mask: torch.Tensor, *, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences with at least one counted token: ``per_sequence``'s count."""
    ids = sequence_ids if sequence_ids is not None else _sequence_ids(mask)
    ids = torch.where(mask.bool(), ids, -1)
    return torch.tensor(torch.unique(ids[ids >= 0]).numel())


def per_sequence(
    losses: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's mean over its tokens, then the mean over the window's sequences
    (GRPO as published: ``loss_type="grpo"``; SFT that weighs sequences, not tokens). Rows
    are sequences, or packed ones given by ``sequence_ids`` (``ga.sequence_ids``)."""
    mask = _mask(losses, mask, "per_sequence")
    ids = sequence_ids if sequence_ids is not None else _sequence_ids(mask)
    ids = torch.where(mask, ids, -1)
    means, _ = _per_sequence_means(losses, mask, ids)
    return means.sum(), torch.tensor(means.numel())


def group_count(mask: torch.Tensor, group_size: torch.Tensor) -> torch.Tensor:
    """Groups' share in this micro-batch: each sequence that counts adds 1 / its group's
    size, so a window adds up to its number of groups: ``per_group``'s count."""
    rows = mask.bool().any(dim=1)
    return (rows.double() / group_size.double()).sum()


def per_group(
    losses: torch.Tensor, mask: torch.Tensor | None, group_size: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's mean over its tokens, the mean over each prompt's group of
    completions, then the mean over the window's groups. ``group_size`` (batch,): the number
    of completions of each row's prompt in the whole window (over ranks), which may differ
    from group to group (completions filtered out, DAPO's dynamic sampling). A group may span
    micro-batches: its share of the count is 1 / its size per completion."""
    mask = _mask(losses, mask, "per_group")
    if group_size.shape != losses.shape[:1] or (group_size <= 0).any():
        raise ValueError(
            f"per_group: group_size must hold each row's positive group size, shape "
            f"{tuple(losses.shape[:1])}, got shape {tuple(group_size.shape)}"
        )
    ids = torch.where(mask, _sequence_ids(mask), -1)
    means, present = _per_sequence_means(losses, mask, ids)
    rows = mask.any(dim=1)
    return (means / group_size[rows].to(means.dtype)).sum(), group_count(mask, group_size)


def constant_normalizer(
    losses: torch.Tensor, mask: torch.Tensor | None, constant: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's token sum divided by a constant (the longest completion allowed), then
    the mean over the window's sequences: Dr. GRPO's unbiased normalizer (TRL's
    ``loss_type="dr_grpo"``, ``max_completion_length`` as the constant). Count: the rows."""
    mask = _mask(losses, mask, "constant_normalizer")
    if isinstance(constant, bool) or not isinstance(constant, numbers.Real) or not constant > 0:
        raise ValueError(
            f"constant_normalizer: constant must be a positive number, got {constant!r}"
        )
    return torch.where(mask, losses, 0).sum() / constant, torch.tensor(losses.shape[0])


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


# -- a mixture-of-experts model's router load-balancing term -------------------------------------
#
# Hugging Face's MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) add coefficient x
# E * sum_e f_e * P_e to their loss (load_balancing_loss_func, Switch Transformer's), over every
# layer's routed tokens where the attention mask is 1: f_e the share of top-k assignments that
# went to expert e, P_e the mean router probability of e. It is a product of two means over the
# batch, and f_e carries no gradient, so the batch's gradient is E * sum_e f_e * grad(sum of
# probabilities of e) / rows: a sum over routed rows once f_e is the whole window's. f_e needs
# every micro-batch's routing before the first backward (a pass without gradient over the
# window gives it); then each micro-batch's term is a sum over its rows, counted by its rows.


def _router_rows(
    router_logits: Any, num_experts: int, mask: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise ValueError(
            "router_logits must be a non-empty tuple of one (tokens, num_experts) tensor per "
            f"layer, got {type(router_logits).__name__}"
        )
    layers = list(router_logits)
    for layer in layers:
        if layer.dim() != 2 or layer.shape[-1] != num_experts:
            raise ValueError(
                f"router_logits must be (tokens, {num_experts}) per layer, got {tuple(layer.shape)}"
            )
    if mask is None:
        return layers, None
    flat = mask.reshape(-1).to(device=layers[0].device, dtype=torch.float32)
    if any(layer.shape[0] != flat.numel() for layer in layers):
        raise ValueError(
            f"router_logits' rows ({layers[0].shape[0]}) are not the mask's tokens ({flat.numel()})"
        )
    return layers, flat


def routing_counts(
    router_logits: Any, num_experts: int, top_k: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How a mixture-of-experts model routed a micro-batch, as transformers'
    ``load_balancing_loss_func`` counts it: each expert's top-k assignments summed over every
    layer's tokens where ``mask`` (the attention mask) is 1, shape ``(num_experts,)``, and the
    routed rows (layers x those tokens), both float32 with no gradient. ``router_logits``:
    one ``(tokens, num_experts)`` tensor per layer, rows in ``mask.reshape(-1)``'s order.
    Summed over a window (and its ranks), the assignments over the rows are the window's
    ``fraction`` for :func:`load_balancing`."""
    layers, flat = _router_rows(router_logits, num_experts, mask)
    device = layers[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        for layer in layers:
            _, chosen = torch.topk(F.softmax(layer.detach(), dim=-1), top_k, dim=-1)
            weight = (
                torch.ones(chosen.numel(), device=device)
                if flat is None
                else flat.repeat_interleave(top_k)
            )
            assigned.scatter_add_(0, chosen.reshape(-1), weight)
            rows += layer.shape[0] if flat is None else flat.sum()
    return assigned, rows


def load_balancing(
    router_logits: Any,
    num_experts: int,
    fraction: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's router load-balancing term as ``(loss_sum, count)``: ``num_experts x
    sum_e fraction_e x`` (expert e's router probability summed over the micro-batch's routed
    rows), and the routed rows. ``fraction``: the whole window's share of assignments per
    expert (:func:`routing_counts` summed over the window's micro-batches and ranks, over
    its rows), a constant. The window's sum over its rows is then transformers'
    ``load_balancing_loss_func`` over the whole window, and its gradient the whole window's
    (give the model's coefficient as the term's weight)."""
    layers, flat = _router_rows(router_logits, num_experts, mask)
    if fraction.shape != (num_experts,):
        raise ValueError(
            f"fraction must hold one share per expert, shape ({num_experts},), got "
            f"{tuple(fraction.shape)}"
        )
    fraction = fraction.detach().to(device=layers[0].device, dtype=torch.float32)
    total: torch.Tensor | None = None
    rows = torch.zeros((), dtype=torch.float32, device=layers[0].device)
    for layer in layers:
        probs = F.softmax(layer, dim=-1).float()
        if flat is not None:
            probs = probs * flat.unsqueeze(-1)
        part = (probs.sum(dim=0) * fraction).sum()
        total = part if total is None else total + part
        rows += layer.shape[0] if flat is None else flat.sum().detach()
    return total * num_experts, rows
