"""A model of CUDA's caching allocator (PyTorch's c10/cuda/CUDACachingAllocator.cpp), in pure
Python: replay an allocation and free sequence and read what ``torch.cuda.max_memory_allocated()``
and ``torch.cuda.max_memory_reserved()`` would report for it.

The rules, each named after the function of the allocator's source that holds it (the list with
its constants is in docs/planning.md, "The CUDA allocator model"):

- ``round_size``: every request is rounded up to a multiple of 512 bytes (at least 512), or to
  the next power-of-two division when ``roundup_power2_divisions`` is set.
- ``get_pool``: a rounded size up to 1 MiB is served from the small pool, larger from the large.
- ``get_allocation_size``: a new segment (``cudaMalloc``) is 2 MiB for the small pool, 20 MiB for
  a request under 10 MiB, and the request rounded up to 2 MiB above.
- ``get_free_block``: the smallest cached free block that holds the request (best fit, ties to
  the lower address); with ``max_split_size``, a request under it never takes a block at or over
  it, and a request at or over it takes only a block less than 20 MiB larger.
- ``should_split``: a block larger than the request is split when the remainder is at least 512
  bytes (small pool, or expandable segments), or when the request is under ``max_split_size``
  and the remainder is over 1 MiB (large pool); otherwise the whole block is handed out and
  counted as allocated.
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours of the same
  segment; segments are never returned to the device (no ``empty_cache``, no out-of-memory
  retry), so reserved only grows.
- ``expandable_segments``: one segment per pool grows in pages (2 MiB small, 20 MiB large),
  mapping at its end only what the request lacks beyond the free block there.

What it leaves out: streams (one stream, as a training loop without side streams uses), CUDA
graphs' private pools, and the release of cached segments when ``cudaMalloc`` fails (a peak
that fits never triggers it).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MIN_BLOCK",
    "AllocatorConfig",
    "CachingAllocator",
    "Replay",
    "replay",
    "replay_snapshot",
    "round_size",
    "to_snapshot",
]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment for requests between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
_UNLIMITED = 2**64 - 1  # max_split_size's default (SIZE_MAX)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The allocator settings that change reserved memory (``PYTORCH_CUDA_ALLOC_CONF``)."""

    expandable_segments: bool = False
    """Grow one segment per pool instead of allocating a segment per miss."""
    max_split_size: int | None = None
    """Bytes; blocks this large or larger are never split (None: no limit, the default)."""
    roundup_power2_divisions: int = 0
    """Round each request up to one of this many divisions between powers of two (0: off)."""

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= 0:
            raise ValueError(f"max_split_size must be positive bytes, got {self.max_split_size}")
        d = self.roundup_power2_divisions
        if d and (d < 2 or d & (d - 1)):
            raise ValueError(f"roundup_power2_divisions must be a power of two >= 2, got {d}")

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """Read a ``PYTORCH_CUDA_ALLOC_CONF`` value, e.g. ``"expandable_segments:True,
        max_split_size_mb:128"``; other keys do not change the peak and are ignored."""
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                values["expandable_segments"] = value.strip().lower() == "true"
            elif key == "max_split_size_mb":
                # the allocator raises a smaller value to its large segment size
                values["max_split_size"] = max(int(value) << 20, LARGE_BUFFER)
            elif key == "roundup_power2_divisions" and value.strip().isdigit():
                values["roundup_power2_divisions"] = int(value)
        return cls(**values)

    @property
    def split_limit(self) -> int:
        return _UNLIMITED if self.max_split_size is None else self.max_split_size


def round_size(size: int, divisions: int = 0) -> int:
    """A request's size as the allocator rounds it (``round_size``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        step = (1 << (size.bit_length() - 1)) // divisions
        floor = size & ~(step - 1)
        return size if floor == size else floor + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def _allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "allocated", "next", "pool", "prev", "size")

    def __init__(self, addr: int, size: int, pool: _Pool) -> None:
        self.addr, self.size, self.pool = addr, size, pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


class _Pool:
    """One pool's cached free blocks, ordered by (size, address) as the allocator's set is."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.tail: _Block | None = None  # an expandable segment's last mapped block
        self.mapped_end = 0  # an expandable segment's mapped extent

    def insert(self, block: _Block) -> None:
        bisect.insort(self.keys, block.key)
        self.blocks[block.key] = block

    def remove(self, block: _Block) -> None:
        key = block.key
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]


class CachingAllocator:
    """The allocator's state for one device and one stream. ``malloc(size)`` returns a handle
    for ``free(handle)``; ``allocated``/``reserved`` and their peaks are read as attributes."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self._small, self._large = _Pool(small=True), _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._handles = itertools.count()
        self._next_addr = 0  # segments are laid out one after another in address order
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = 0

    def malloc(self, size: int) -> int:
        if size < 0:
            raise ValueError(f"an allocation's size must be >= 0 bytes, got {size}")
        handle = next(self._handles)
        if size == 0:  # the allocator hands out no block for an empty tensor
            return handle
        rounded = round_size(size, self.config.roundup_power2_divisions)
        pool = self._small if rounded <= SMALL_SIZE else self._large
        block = self._free_block(pool, rounded)
        if block is None:
            block = self._new_block(pool, rounded)
        else:
            pool.remove(block)
        if self._should_split(block, rounded):
            rest = _Block(block.addr + rounded, block.size - rounded, pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            if pool.tail is block:
                pool.tail = rest
            pool.insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle, None)
        if block is None:  # an empty allocation
            return
        block.allocated = False
        self.allocated -= block.size
        pool = block.pool
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    block.addr, block.prev = neighbour.addr, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                    if pool.tail is neighbour:
                        pool.tail = block
                block.size += neighbour.size
        pool.insert(block)

    # -- the allocator's rules ---------------------------------------------------------------

    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        index = bisect.bisect_left(pool.keys, (size, -1))
        if index == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[index]]
        if self.config.expandable_segments and block is pool.tail:
            # the block at the segment's mapped end counts as the size it can grow to: any other
            # block that holds the request is a better fit
            if index + 1 < len(pool.keys):
                block = pool.blocks[pool.keys[index + 1]]
        limit = self.config.split_limit
        if size < limit and block.size >= limit:
            return None
        if size >= limit and block.size >= size + LARGE_BUFFER:
            return None
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.split_limit and remaining > SMALL_SIZE

    def _new_block(self, pool: _Pool, size: int) -> _Block:
        if not self.config.expandable_segments:
            grant = _allocation_size(size)
            block = _Block(self._next_addr, grant, pool)
            self._next_addr += grant
            self.segments += 1
            self._reserve(grant)
            return block
        # expandable: map the pages the request lacks beyond the free block at the mapped end
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        tail = pool.tail if pool.tail is not None and not pool.tail.allocated else None
        have = tail.size if tail is not None else 0
        grant = -(-(size - have) // page) * page
        self._reserve(grant)
        if pool.mapped_end == 0:
            self.segments += 1
        if tail is not None:
            pool.remove(tail)
            tail.size += grant
            pool.mapped_end += grant
            return tail
        block = _Block(pool.mapped_end, grant, pool)
        block.prev = pool.tail
        if pool.tail is not None:
            pool.tail.next = block
        pool.tail = block
        pool.mapped_end += grant
        # addresses of the two pools' segments never meet
        block.addr += 0 if pool.small else 1 << 60
        return block

    def _reserve(self, grant: int) -> None:
        self.reserved += grant
        self.peak_reserved = max(self.peak_reserved, self.reserved)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the allocator reports after a sequence: peaks and what is held at the end."""

    peak_allocated: int
    peak_reserved: int
    allocated: int
    reserved: int
    segments: int
    peak_index: int = 0
    """How many events had run when the allocated peak was reached."""


def replay(events: Iterable[tuple[str, int, int]], config: AllocatorConfig | None = None) -> Replay:
    """Replay ``(action, key, size)`` events, action ``"alloc"`` or ``"free"``; ``key`` names
    the allocation a free ends (any hashable id), ``size`` the requested bytes."""
    allocator = CachingAllocator(config)
    handles: dict[Any, int] = {}
    peak_index = 0
    for index, (action, key, size) in enumerate(events, 1):
        if action == "alloc":
            if key in handles:
                raise ValueError(f"allocation {key!r} made twice without a free in between")
            before = allocator.peak_allocated
            handles[key] = allocator.malloc(size)
            if allocator.peak_allocated > before:
                peak_index = index
        elif action == "free":
            if key not in handles:
                raise ValueError(f"free of {key!r}, which is not allocated")
            allocator.free(handles.pop(key))
        else:
            raise ValueError(f"event action must be 'alloc' or 'free', got {action!r}")
    return Replay(
        allocator.peak_allocated,
        allocator.peak_reserved,
        allocator.allocated,
        allocator.reserved,
        allocator.segments,
        peak_index,
    )


def replay_snapshot(snapshot: Mapping[str, Any], config: AllocatorConfig | None = None) -> Replay:
    """Replay a ``torch.cuda.memory._snapshot()`` dict (what ``_record_memory_history`` records,
    as ``_dump_snapshot`` pickles it): device 0's ``device_traces``, its ``alloc`` entries and
    the ``free_completed`` that return each block. The allocator actions recorded beside them
    (segment_alloc, segment_map, ...) are what this model computes, so they are not read.

    A trace that starts with tensors already live lists them in ``segments`` only; each of those
    blocks is allocated first, in address order."""
    traces = snapshot.get("device_traces") or [[]]

    def events():
        for segment in sorted(snapshot.get("segments", ()), key=lambda s: s["address"]):
            addr = segment["address"]
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    yield "alloc", addr, block.get("requested_size", block["size"])
                addr += block["size"]
        for entry in traces[0]:
            if entry["action"] == "alloc":
                yield "alloc", entry["addr"], entry["size"]
            elif entry["action"] == "free_completed":
                yield "free", entry["addr"], entry["size"]

    return replay(events(), config)


def to_snapshot(events: Iterable[tuple[str, Any, int]]) -> dict[str, Any]:
    """``(action, key, size)`` events as a ``torch.cuda.memory._snapshot()`` dict: device 0's
    trace of ``alloc`` and ``free_requested``/``free_completed`` entries, each allocation at an
    address of its own (the keys are numbered in the order they first appear)."""
    addresses: dict[Any, int] = {}
    sizes: dict[Any, int] = {}
    trace = []
    for action, key, size in events:
        if action == "alloc":
            addr = addresses.setdefault(key, (len(addresses) + 1) << 12)
            sizes[key] = size
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})
        else:
            addr, size = addresses[key], sizes[key]
            for step in ("free_requested", "free_completed"):
                trace.append({"action": step, "addr": addr, "size": size, "stream": 0})
    return {"segments": [], "device_traces": [trace]}
