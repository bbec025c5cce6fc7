"""The window of a loop that another framework runs, with the engine's arithmetic.

A framework (Hugging Face's Trainer, Lightning) owns the loop: it calls backward on each
micro-batch, reduces gradients across ranks on the window's last one, clips and steps. The
integrations only tell this class what each micro-batch held, and call ``end`` between the
last backward and the framework's clipping. The window's numbers are a ``window.Tally`` and
its end is ``window.Closing.close``, as the Accumulator's ``end_window``'s: every path
computes the same thing.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.noise import NoiseScale
from gradaccum.schedule import BatchSchedule
from gradaccum.sync import Sync
from gradaccum.window import Closing, StepResult, Tally

__all__ = ["FrameworkWindow", "ScheduledWindows", "noise_option"]


def noise_option(noise: NoiseScale | bool) -> NoiseScale | None:
    """An integration's ``noise=`` argument: True for ``NoiseScale()``, False for none, or a
    ``NoiseScale`` of the user's."""
    if noise is True:
        return NoiseScale()
    if noise is False:
        return None
    if not isinstance(noise, NoiseScale):
        raise TypeError(f"noise must be a NoiseScale, True or False, got {type(noise).__name__}")
    return noise


class FrameworkWindow:
    """Counts and losses of the micro-batches of one window at a time, then its one division.

    ``model``: the module as the framework runs it (``DistributedDataParallel`` under DDP):
    ``Sync`` reads the world and the process group off it; or ``sync``, one built for the
    purpose (``PipelineSync(group)`` for a pipeline's stages). ``noise``: a ``NoiseScale``
    fed from the window's prefixes, or None.
    """

    def __init__(
        self, model: torch.nn.Module | None, noise: NoiseScale | None, sync: Sync | None = None
    ) -> None:
        self.sync = sync if sync is not None else Sync.of(model)
        self.noise = noise
        self.tally = Tally()
        self.closing = Closing(self.sync, noise=noise)

    def begin(self, counts: Any) -> None:
        """A window whose loss is named terms: this rank's count of each term over the whole
        window, before its first backward (``Tally.begin``: summed over ranks here)."""
        self.tally.begin(counts, self.sync)

    def record(self, loss: Any, count: Any = None) -> tuple[torch.Tensor, Any]:
        """One micro-batch's loss before its backward: ``(loss_sum, count)``, or named terms
        (a mapping, count None) in a window begun with their counts. Returns the loss whose
        backward the framework runs, and the count ``after_backward`` takes."""
        return self.tally.add(loss, count)

    def after_backward(
        self, count: Any, grads: list[torch.Tensor] | None = None, multiplier: float = 1.0
    ) -> None:
        """After a recorded micro-batch's backward. ``grads``: the window's gradient so far,
        carrying ``multiplier`` times the summed losses' gradient, for the noise estimate
        (``NoiseScale.record``: the same prefix rule as the Accumulator's). As in the engine,
        nothing here waits for the device: losses and GPU counts are summed where they are
        and read once, at ``end``."""
        if self.noise is not None and grads is not None:
            self.noise.record(grads, count, multiplier)

    def add(
        self,
        loss_sum: Any,
        count: Any,
        grads: list[torch.Tensor] | None = None,
        multiplier: float = 1.0,
    ) -> None:
        """``record`` and ``after_backward`` at once, for a framework that tells the window
        what a micro-batch held only after its backward (Lightning's callback): a pair."""
        _, count = self.record(loss_sum, count)
        self.after_backward(count, grads, multiplier)

    def drop(self) -> None:
        """Forget the window so far (its counts, losses and noise prefixes), as when it is
        replayed after an out-of-memory error; the caller drops its gradient."""
        self.tally = Tally()
        if self.noise is not None:
            self.noise.drop_window()

    @property
    def micro_batches(self) -> int:
        """Micro-batches recorded in the window so far."""
        return self.tally.micro_batches

    def end(
        self,
        grads: list[torch.Tensor],
        carried: float = 1.0,
        scale: float = 1.0,
        max_grad_norm: float | None = None,
    ) -> StepResult:
        """Divide the window's gradient (``grads``, in place) once by its global item count.

        ``carried``: what the framework already divided the summed losses by before
        backward (Lightning's ``1 / accumulate_grad_batches``), divided out here too;
        ``scale``: an fp16 loss scale still on the gradient, which the framework divides out
        itself later (only the norm reported here is corrected for it); ``max_grad_norm``:
        clip here, by ``window.finish``'s rule (frameworks that clip themselves leave it None).
        The window ends through ``Closing.close``, as the Accumulator's does, without its step
        (the framework's loop steps): the result says what gradaccum decided."""
        self.closing.max_grad_norm = max_grad_norm
        tally, self.tally = self.tally, Tally()
        return self.closing.close(tally, lambda: (grads, carried), scale=scale)


class ScheduledWindows:
    """A ``BatchSchedule`` in a loop another framework runs, which steps when its count of
    the epoch's micro-batches so far is a multiple of its accumulation setting N (the
    Hugging Face Trainer's ``gradient_accumulation_steps``, Lightning's
    ``accumulate_grad_batches``), read afresh at every micro-batch.

    At each window's start, ``next_window(done)`` gives the window's length in micro-batches
    (the schedule's batch over the micro-batch size and the processes) and the N that makes
    the framework step after exactly that many: the epoch's count at the window's end, whose
    next multiple lies beyond it. So every window is the schedule's, whatever the lengths
    before it. The schedule is told the samples each window really held (an epoch's last
    window may hold fewer)."""

    def __init__(
        self,
        schedule: BatchSchedule,
        micro_size: int,
        world: int = 1,
    ) -> None:
        if not isinstance(schedule, BatchSchedule):
            raise TypeError(
                f"schedule must be a gradaccum.BatchSchedule, got {type(schedule).__name__}"
            )
        if schedule.unit % (micro_size * world):
            raise ValueError(
                f"the schedule's unit ({schedule.unit}) must be a multiple of the micro-batch "
                f"size times the processes ({micro_size} x {world}): a window is whole "
                "micro-batches"
            )
        if schedule.start % (micro_size * world):
            raise ValueError(
                f"the schedule's start ({schedule.start}) must be a multiple of the micro-batch "
                f"size times the processes ({micro_size} x {world}): a window is whole "
                "micro-batches"
            )
        self.schedule, self.micro_size, self.world = schedule, micro_size, world

    def smallest(self) -> int:
        """The fewest micro-batches any window of the schedule asks for (a framework that
        counts its optimizer steps per epoch up front counts enough of them with it)."""
        s = self.schedule
        batches = [s.start] + [s.whole(b) for _, b in s.points]
        return max(1, min(batches) // (self.micro_size * self.world))

    def next_window(self, done: int) -> tuple[int, int]:
        """(N, micro-batches in the window) for a window that starts after ``done``
        micro-batches of the epoch."""
        length = max(1, self.schedule.size() // (self.micro_size * self.world))
        return done + length, length

    def window_done(self, end: StepResult, samples: int) -> None:
        """After a window that held ``samples`` samples on this process (``end``: what the
        window's end computed: its global count and B_simple's interval)."""
        self.schedule.update(end, samples * self.world)
