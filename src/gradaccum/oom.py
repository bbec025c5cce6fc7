"""Out of memory inside a window: replay the same window at half the micro-batch size.

The window's data is still at hand when a forward or backward runs out of memory, so
nothing is lost: the Accumulator drops the window's gradients (parameters untouched),
``OOMReplay`` halves the micro-batch size, re-splits the same micro-batches and runs them
again through the Accumulator's own ``micro_batch()``/``backward()``. The step still sees
every sample exactly once, and its gradient is the same full-batch mean. After
``grow_after`` clean windows the size doubles again, back up to the sizes given, never above
them (those are the plan's limit).

Only in ``step()`` (a hand-written loop owns its micro-batches). Under DDP the ranks replay
together: no collective runs inside the window's micro-batches then (``gradaccum.sync``
reduces the window's sum at its end), so a rank that runs out of memory midway stops its
window and waits in one small all-reduce after it, where every rank learns whether any ran
out and the largest micro-batch any ran; all of them drop the window and replay it at half
that size, so the global batch stays exact, and they grow back together (their counts of
clean windows are equal). Under FSDP2 a forward gathers parameters across ranks, so a rank
cannot leave it midway: refused there.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.batching import batch_size, split
from gradaccum.validate import positive_int

__all__ = ["OOMReplay"]

log = logging.getLogger("gradaccum")


@dataclass
class OOMReplay:
    """The policy and its state: ``cap`` is the largest micro-batch size allowed now (None:
    as given), ``clean_windows`` the windows run without running out since the last change.
    One instance per Accumulator; its state travels with the Accumulator's checkpoints."""

    grow_after: int = 50
    cap: int | None = None
    clean_windows: int = 0

    def __post_init__(self) -> None:
        positive_int(self.grow_after, "grow_after")

    def run(
        self,
        given: list[Any],
        attempt: Callable[[list[Any]], None],
        window: int,
        agree: Callable[[bool, int], tuple[bool, int]] | None = None,
        drop: Callable[[], None] | None = None,
    ) -> int:
        """Run ``attempt`` (forward and backward of every micro-batch it is handed) on
        ``given`` split to the cap; on out-of-memory, shrink and run it again. Returns how
        many times the window was replayed; re-raises when it cannot be split smaller.

        Across ranks, ``agree(failed here, largest size run here) -> (failed anywhere,
        largest anywhere)`` after each attempt, and ``drop()`` discards the window on the
        ranks whose attempt finished."""
        replays = 0
        while True:
            run = self.arrange(given)
            error = None
            try:
                attempt(run)
            except torch.OutOfMemoryError as err:
                # The Accumulator has dropped the window. Decide after the except block; the
                # error (its traceback holds the failed forward's activations) is kept only
                # until it is known whether the window replays.
                error = err
            failed, largest = error is not None, _largest(run)
            if agree is not None:
                failed, largest = agree(failed, largest or 0)
                if failed and drop is not None:
                    drop()
            if not failed:
                break
            if self.shrink(largest, window) is None:
                if error is not None:
                    raise error
                raise torch.OutOfMemoryError(
                    f"window {window}: another rank ran out of memory at micro-batch size "
                    f"{largest}, and there is nothing smaller to replay the window at"
                )
            error = None
            replays += 1
            free_memory()
        if replays == 0:
            self.window_done(given, window)
        return replays

    def arrange(self, micro_batches: list[Any]) -> list[Any]:
        """The micro-batches to run: each given one, split further if above the cap."""
        if self.cap is None:
            return micro_batches
        out: list[Any] = []
        for mb in micro_batches:
            out.extend(split(mb, self.cap) if batch_size(mb) > self.cap else [mb])
        return out

    def shrink(self, largest: int | None, window: int) -> int | None:
        """After an OOM at micro-batch size ``largest``: the new cap, or None when the
        window cannot be split smaller."""
        if largest is None or largest <= 1:
            return None
        self.cap = math.ceil(largest / 2)
        self.clean_windows = 0
        log.warning(
            "window %d: out of memory at micro-batch size %d; replaying the window at %d "
            "(every sample once)",
            window,
            largest,
            self.cap,
        )
        return self.cap

    def window_done(self, given: list[Any], window: int) -> None:
        """Count a clean window; after ``grow_after`` of them, double the cap."""
        if self.cap is None:
            return
        self.clean_windows += 1
        if self.clean_windows < self.grow_after:
            return
        self.clean_windows = 0
        limit = max(batch_size(mb) for mb in given)
        grown = self.cap * 2
        self.cap = None if grown >= limit else grown
        log.info(
            "window %d: %d clean windows; growing the micro-batch back to %s",
            window,
            self.grow_after,
            limit if self.cap is None else self.cap,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "clean_windows": self.clean_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap = state["cap"]
        self.clean_windows = state["clean_windows"]


def free_memory() -> None:
    """What a failed attempt held, back to the allocator before the replay: Python's cycles
    (a traceback's frames hold its tensors) and, on CUDA, the caching allocator's free
    blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _largest(micro_batches: list[Any]) -> int | None:
    """The largest micro-batch's size, or None for micro-batches that are not tensors (they
    cannot be re-split)."""
    try:
        return max(batch_size(mb) for mb in micro_batches)
    except (TypeError, ValueError):
        return None
