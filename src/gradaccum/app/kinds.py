"""The kinds of run: one process or DDP replicas, FSDP2 shards, pipeline stages.

Each kind is a class with the small interface the loop and the report use: how the batch
reaches this process, how one window runs, what a checkpoint holds of this process's part
and how it is restored, which module evaluates, and how the whole model is gathered at the
end. The loop calls these and never asks which kind it has; what differs between kinds
lives here, and how each is built lives in build.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch
from gradaccum.app.folder import RunFolder
from gradaccum.batching import shard, split
from gradaccum.window import StepResult

__all__ = ["Pipelined", "Replicated", "RunKind", "Sharded"]


class RunKind:
    """The interface, with what one process and DDP do (``Replicated``): each rank trains a
    share of the batch through an Accumulator, rank 0 alone evaluates and writes."""

    #: every rank takes part in each forward, evaluation included (a pipeline's stages, or
    #: FSDP2's ranks gathering each block's parameters)
    together = False

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Processes that each train a share of the batch."""
        return self.world

    def across(self, cfg: Any) -> str:
        """How the window is spread, for the run's first line ("" in one process)."""
        return f" on each of {self.replicas} processes" if self.replicas > 1 else ""

    def local(self, batch: Any) -> Any:
        """This process's part of the window's batch."""
        return shard(batch, self.rank, self.replicas) if self.replicas > 1 else batch

    def step(self, acc: Any, batch: Any, micro: int, loss_fn: Any) -> StepResult:
        """One window: the batch cut into micro-batches of ``micro``, one optimizer step."""
        return acc.step(split(batch, micro), loss_fn)

    def agree(self, value: Any) -> Any:
        """Rank 0's value on the ranks that act on it together (all of them when together;
        else rank 0 alone acts, and its own value is what counts)."""
        return launch.broadcast(value) if self.together else value

    def evaluates(self) -> bool:
        """Whether this process runs the held-out evaluation."""
        return self.main or self.together

    def evaluated(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module that evaluates: the model as trained."""
        return model

    def sync_mode(self, acc: Any) -> str:
        """The gradient sync a checkpoint records (a resume keeps it)."""
        return acc.sync.mode

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        """This process's part of step ``step``'s checkpoint, written where it belongs, before
        rank 0 commits checkpoint.pt. Returns what checkpoint.pt holds as ``accumulator``
        (None: rank 0's ``acc.state_dict()``). Raises ValueError, on every rank alike, when a
        part could not be written."""
        return None

    def load_saved(
        self, folder: RunFolder, device: torch.device, file: Path | None = None
    ) -> dict[str, Any] | None:
        """The run's checkpoint (checkpoint.pt, or a kept ``file``), with this process's part
        in ``accumulator``."""
        return folder.load_checkpoint(device, file)

    def restore(self, acc: Any, folder: RunFolder, state: Any) -> None:
        """``acc`` as the checkpoint's ``accumulator`` (``load_saved``'s) left it."""
        acc.load_state_dict(state)

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        """After a commit: the parts of steps no checkpoint names any more."""

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, when this process does not hold it whole (every
        rank takes part); None when the model is whole here already."""
        return None


class Replicated(RunKind):
    """One process, or DDP: every rank holds the whole model (``RunKind``'s behaviour)."""


class Sharded(RunKind):
    """FSDP2 (``--shard fsdp``): each rank holds shards of the model and the optimizer. The
    ranks write their shards together through torch.distributed.checkpoint and rank 0's
    checkpoint.pt names the folder; the whole model is gathered at the end."""

    together = True

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        problem = folder.prepare_shards(step) if self.main else None
        if not launch.any_rank(problem is not None):
            try:
                folder.save_shards(acc, step)
            except ValueError as err:
                problem = str(err)
        if launch.any_rank(problem is not None):
            raise ValueError(problem or "another rank could not write its shards")
        return {"shards": folder.commit_shards(step) if self.main else None}

    def restore(self, acc: Any, folder: RunFolder, state: Any) -> None:
        folder.load_shards(acc, state["shards"])

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        folder.prune_parts(keep_steps)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)


class Pipelined(RunKind):
    """Pipeline stages (``--pipeline-stages``), one per process, sharing one batch: the
    schedule cuts it into the window's micro-batches. Stage S > 0 writes its own part of each
    checkpoint; evaluation chains the stages."""

    together = True

    def __init__(self, rank: int, world: int, schedule: str, chained: torch.nn.Module) -> None:
        super().__init__(rank, world)
        self.schedule, self.chained = schedule, chained

    @property
    def replicas(self) -> int:
        return 1  # pipeline replicas under data parallelism are not built

    def across(self, cfg: Any) -> str:
        return f" through {self.world} pipeline stages ({self.schedule})"

    def step(self, acc: Any, batch: Any, micro: int, loss_fn: Any) -> StepResult:
        return acc.step(batch["input_ids"], target=batch["labels"])

    def evaluated(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.chained

    def sync_mode(self, acc: Any) -> str:
        return "window"

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        problem = None
        if not self.main:
            try:
                folder.save_stage(self.rank, step, {"step": step, "accumulator": acc.state_dict()})
            except ValueError as err:
                problem = str(err)
        if launch.any_rank(problem is not None):  # every stage's part, or no commit
            raise ValueError(problem or "another stage could not write its part")
        return None

    def load_saved(
        self, folder: RunFolder, device: torch.device, file: Path | None = None
    ) -> dict[str, Any] | None:
        saved = folder.load_checkpoint(device, file)
        if saved is not None and not self.main:
            saved["accumulator"] = folder.load_stage(self.rank, saved["step"], device)[
                "accumulator"
            ]
        return saved

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        folder.prune_parts(keep_steps)
