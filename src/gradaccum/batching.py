"""Split a batch into micro-batches and group micro-batches into windows.

A batch is a tensor or a (possibly nested) tuple, list or mapping of tensors whose first
dimension is the sample dimension. Tuples and lists are read as *fields* (inputs, labels),
not as samples; every tensor leaf must hold the same number of samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from gradaccum.validate import positive_int

__all__ = [
    "batch_size",
    "join_batches",
    "largest_share",
    "map_tensors",
    "shard",
    "split",
    "take",
    "to_device",
    "windows",
]


def _leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            yield from _leaves(value, f"{path}[{i}]")
    elif batch is None:
        return
    else:
        raise TypeError(
            f"{path} is a {type(batch).__name__}; a batch holds tensors in tuples, lists or "
            "mappings (None is passed through)"
        )


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the common size of dim 0 of every tensor in it."""
    sizes: dict[str, int] = {}
    for path, tensor in _leaves(batch):
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor; every tensor needs a sample dimension 0")
        sizes[path] = tensor.shape[0]
    if not sizes:
        raise ValueError("batch holds no tensor to split")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(f"tensors in the batch disagree on the number of samples ({listed})")
    return next(iter(sizes.values()))


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, its containers kept: the user's
    mapping type (a Hugging Face BatchEncoding, an OrderedDict), namedtuples, tuples, lists.
    Anything else (None) is passed through."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def _rebuild(batch: Any, start: int, length: int) -> Any:
    return map_tensors(batch, lambda t: t.narrow(0, start, length))


def split(batch: Any, micro_size: int) -> list[Any]:
    """Split ``batch`` along dim 0 into micro-batches of ``micro_size`` samples.

    The last micro-batch holds the remainder when ``micro_size`` does not divide the batch;
    every sample appears in exactly one micro-batch. Micro-batches are views, not copies,
    and keep the batch's container types. An empty batch gives an empty list.
    """
    positive_int(micro_size, "micro_size")
    total = batch_size(batch)
    return [
        _rebuild(batch, start, min(micro_size, total - start))
        for start in range(0, total, micro_size)
    ]


def windows(micro_batches: Iterable[Any], n: int) -> Iterator[list[Any]]:
    """Group an iterable of micro-batches into windows of ``n`` (one optimizer step each).

    Lazy, so it works on a DataLoader. The last window keeps whatever is left (it may be
    shorter than ``n``); the Accumulator normalizes it by its own item count, so it is still
    an exact mean-gradient step over the samples it holds.
    """
    positive_int(n, "n (micro-batches per window)")
    window: list[Any] = []
    for micro_batch in micro_batches:
        window.append(micro_batch)
        if len(window) == n:
            yield window
            window = []
    if window:
        yield window


def largest_share(size: int, world: int) -> int:
    """The samples of the fullest of ``world`` processes that split a batch of ``size``
    (``shard``: shares differ by at most one), the per-rank batch a plan is made for; refuses
    a batch smaller than ``world``, with both numbers."""
    size, world = positive_int(size, "the batch's size"), positive_int(world, "world")
    if size < world:
        raise ValueError(
            f"a batch of {size} samples cannot be split across {world} processes: each needs "
            "at least one"
        )
    return -(-size // world)


def shard(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous share of a global ``batch`` split across ``world`` processes.

    Shares differ by at most one sample (the first ``size % world`` ranks hold one more) and
    together are the whole batch, each sample once. Refuses a batch smaller than ``world``.
    """
    world = positive_int(world, "world")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an integer in [0, {world}), got {rank!r}")
    size = batch_size(batch)
    largest_share(size, world)  # (refuses a batch smaller than world)
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return _rebuild(batch, start, base + (rank < extra))


def take(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``; when it holds fewer, its samples repeated until
    there are ``n`` (a stand-in of the right shape, e.g. for measuring memory)."""
    positive_int(n, "n")
    total = batch_size(batch)
    if total == 0:
        raise ValueError("cannot take samples from an empty batch")
    if n > total:
        times = -(-n // total)
        batch = map_tensors(batch, lambda t: torch.cat([t] * times))
    return _rebuild(batch, 0, n)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device``, containers kept."""
    return map_tensors(batch, lambda t: t.to(device))


def join_batches(batches: list[Any], fills: dict[Any, Any]) -> Any:
    """Micro-batches as one batch: tensors joined on dim 0, padded on dim 1 to the longest
    (``fills``: each key's pad value, or each position's in a tuple or list; 0 otherwise)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return _join([b for b in batches], fills.get(0, 0))
    if isinstance(first, (tuple, list)):
        return type(first)(
            _join([b[i] for b in batches], fills.get(i, 0)) for i in range(len(first))
        )
    return {
        k: _join([b[k] for b in batches], fills.get(k, 0)) if isinstance(v, torch.Tensor) else v
        for k, v in first.items()
    }


def _join(parts: list[torch.Tensor], fill: Any) -> torch.Tensor:
    if parts[0].dim() >= 2:
        longest = max(p.shape[1] for p in parts)
        parts = [
            torch.cat([p, p.new_full((p.shape[0], longest - p.shape[1], *p.shape[2:]), fill)], 1)
            if p.shape[1] < longest
            else p
            for p in parts
        ]
    return torch.cat(parts)
