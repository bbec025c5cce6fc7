"""In-batch negatives: a loss that couples the window's samples, exact under accumulation.

A contrastive loss (multiple-negatives ranking, InfoNCE) scores each sample against every
other sample of its batch: over one micro-batch it sees only that micro-batch's negatives,
so plain accumulation is not the large batch at all. The exact method caches the
embeddings' gradient (GradCache, Gao et al. 2021):

1. every micro-batch is embedded without a graph (the random generators' state kept);
2. the embeddings of the whole window, and of every rank (gathered), make the loss once,
   and its gradient with respect to each embedding is computed;
3. each micro-batch is embedded again, with its graph and the same random state (dropout
   draws the same masks), and backpropagates ``(embedding * cached gradient).sum()``.

Step 3 runs through the Accumulator's public manual API (``begin_window(coupled=True)``,
``micro_batch``, ``backward``; ``step`` ends the window): the summed gradient is divided
once by the loss's count at the end, as for any other loss, under DDP and FSDP2 the last
micro-batch alone communicates, an ``OOMReplay`` replays the window split smaller.
Memory: one micro-batch's activations plus the window's embeddings and their gradient.
Compute: one extra forward per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradaccum.checkpoint import rng_state, set_rng_state
from gradaccum.loss import WindowLoss, unpack

__all__ = ["InBatch"]


class InBatch(WindowLoss):
    """A loss over the whole window's embeddings, for ``acc.step(micro_batches, InBatch(...))``.

    Args:
        embed: ``embed(model, micro_batch)`` -> the micro-batch's embeddings: a tensor, or a
            tuple, list or dict of tensors with samples on dim 0 (queries and documents; a
            tensor of labels may ride along: what is not floating point gets no gradient).
        loss: ``loss(embeddings)`` -> ``(loss_sum, count)`` over the whole window: each part
            of ``embeddings`` is the micro-batches' (and ranks') parts concatenated along dim
            0 in window order (rank 0's micro-batches, then rank 1's, ...). ``count`` is the
            items the loss averages over (queries, pairs), over the whole window.
    """

    def __init__(
        self,
        embed: Callable[[torch.nn.Module, Any], Any],
        loss: Callable[[Any], Any],
    ) -> None:
        for name, fn in (("embed", embed), ("loss", loss)):
            if not callable(fn):
                raise TypeError(f"InBatch's {name} must be callable, got {type(fn).__name__}")
        self.embed, self.loss = embed, loss

    def __repr__(self) -> str:
        return f"InBatch(embed={self.embed!r}, loss={self.loss!r})"

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        """The loss over ``batch`` alone, as a plain ``loss_fn``: a full batch's reference
        (``ga.check``), an evaluation, a probe of one micro-batch's memory. Given to a plain
        loop one micro-batch at a time, it is plain accumulation: each micro-batch's own
        negatives only."""
        return self.loss(self.embed(model, batch))

    def run(self, acc: Any, micro_batches: list[Any], real: int) -> None:
        """One window through ``acc``'s manual API. Micro-batches from ``real`` on are padding
        (``Sync.pad``): they run, for the collectives' sake, and contribute nothing."""
        states, cached = [], []
        for mb in micro_batches:  # 1. without a graph
            states.append(rng_state())
            with torch.no_grad(), acc.precision.autocast():
                cached.append(_parts(self.embed(acc.model, mb), "embed"))
        after = rng_state()
        mine = cached[:real]
        structure = cached[0][1]
        if any(s != structure for _, s in mine):
            raise ValueError(
                "embed returned differently structured embeddings for the window's "
                f"micro-batches ({structure} and {next(s for _, s in mine if s != structure)})"
            )
        empty = [t[:0] for t in cached[0][0]]  # a rank without micro-batches: no rows
        grads, loss_sum, count = self._gradients([p for p, _ in mine], empty, structure, acc.sync)
        # 3. with the graph, each micro-batch's share of the cached gradient
        leader = acc.sync.rank == 0
        acc.begin_window(coupled=True)
        try:
            for index, mb in enumerate(micro_batches):
                with acc.micro_batch(last=index == len(micro_batches) - 1):
                    set_rng_state(states[index])
                    parts, _ = _parts(self.embed(acc.model, mb), "embed")
                    surrogate = None
                    for k, part in enumerate(parts):
                        if index < real and grads[index][k] is not None:
                            term = (part * grads[index][k].to(part.dtype)).sum()
                        elif part.requires_grad:
                            term = part.sum() * 0.0
                        else:
                            continue
                        surrogate = term if surrogate is None else surrogate + term
                    if surrogate is None:
                        raise ValueError("embed returned no embedding that requires grad")
                    # The loss's value is recorded once (the leader's first micro-batch);
                    # the surrogates carry the gradient and add exactly 0 to it.
                    value = surrogate - surrogate.detach()
                    if index == 0 and leader:
                        value = value + loss_sum
                    acc.backward(value, count if index == 0 and leader else 0)
        finally:
            set_rng_state(after)

    def _gradients(
        self,
        mine: list[list[torch.Tensor]],
        empty: list[torch.Tensor],
        structure: Any,
        sync: Any,
    ) -> tuple[list[list[torch.Tensor | None]], torch.Tensor, Any]:
        """2. The window's (and every rank's) embeddings, the loss over them, and its
        gradient with respect to this rank's embeddings, split back by micro-batch."""
        sizes = [p[0].shape[0] for p in mine]
        whole, offsets = [], []
        for k in range(len(empty)):
            local = torch.cat([p[k] for p in mine]) if mine else empty[k]
            gathered, offset = sync.gather(local)
            if gathered.is_floating_point():
                gathered = gathered.detach().requires_grad_(True)
            whole.append(gathered)
            offsets.append(offset)
        with torch.enable_grad():
            loss_sum, count = unpack(self.loss(_rebuild(whole, structure)), 0)
            if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
                raise ValueError("InBatch's loss must return (loss_sum, count), a 0-dim loss_sum")
            leaves = [w for w in whole if w.requires_grad]
            found = torch.autograd.grad(loss_sum, leaves, allow_unused=True) if leaves else []
        by_leaf = dict(zip(map(id, leaves), found, strict=True))
        grads: list[list[torch.Tensor | None]] = [[] for _ in mine]
        for k, w in enumerate(whole):
            g = by_leaf.get(id(w))
            start = offsets[k]
            for i, n in enumerate(sizes):
                if g is None and w.requires_grad:
                    grads[i].append(torch.zeros((n, *w.shape[1:]), dtype=w.dtype, device=w.device))
                else:
                    grads[i].append(None if g is None else g[start : start + n])
                start += n
        return grads, loss_sum.detach(), count


def _parts(embeddings: Any, where: str) -> tuple[list[torch.Tensor], Any]:
    """Embeddings as a flat list of tensors and their structure (for ``_rebuild``)."""
    if isinstance(embeddings, torch.Tensor):
        return [embeddings], ("tensor", None)
    if isinstance(embeddings, Mapping) and all(
        isinstance(v, torch.Tensor) for v in embeddings.values()
    ):
        return list(embeddings.values()), ("dict", tuple(embeddings))
    if isinstance(embeddings, (tuple, list)) and all(
        isinstance(v, torch.Tensor) for v in embeddings
    ):
        return list(embeddings), (type(embeddings).__name__, tuple(range(len(embeddings))))
    raise TypeError(
        f"{where} must return a tensor, or a tuple, list or dict of tensors, got "
        f"{type(embeddings).__name__}"
    )


def _rebuild(parts: list[torch.Tensor], structure: Any) -> Any:
    kind, keys = structure
    if kind == "tensor":
        return parts[0]
    if kind == "dict":
        return dict(zip(keys, parts, strict=True))
    return tuple(parts) if kind == "tuple" else list(parts)
