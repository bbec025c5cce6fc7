"""A run's checkpoints: the files (``Checkpoints``: sealed with a checksum, verified on load,
kept copies for the guard) and when they are written (``Checkpointer``: every
--checkpoint-every steps, at the end, at a stop and when a target is met).

checkpoint.pt is written at window boundaries by rank 0, after the parts other processes
write themselves (a pipeline's later stages, FSDP2's shards: ``RunKind.save_parts``), with the
SHA-256 of everything in it; ``torch.load(..., weights_only=True)`` reads it. A checkpoint of
gradaccum 0.6 or before has no checksum and is read as it is.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch
from gradaccum.app.boundary import Boundary
from gradaccum.app.folder import CHECKPOINT, KEPT, RunFolder, write_failure
from gradaccum.checkpoint import state_digest

__all__ = ["CHECKPOINT_FORMAT", "Checkpointer", "Checkpoints", "sealed"]

CHECKPOINT_FORMAT = "gradaccum.run/1"
DIGEST = "sha256"  # a checkpoint's checksum, over everything else in it
# How many processes trained the run to this checkpoint: a resume on another count is
# allowed only where every window stays exact (gradaccum.app.build), and recorded.
PROCESSES = "processes"


WRITTEN_BY = "written_by"  # the gradaccum version that wrote a checkpoint


class NewerCheckpoint(ValueError):
    """A checkpoint of a format this gradaccum does not read: written by a newer one. Not
    damage: nothing to fall back from, and the run is whole."""


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as written: its format, the version that wrote it, and the checksum of
    everything in it."""
    from gradaccum import __version__

    whole = {"format": CHECKPOINT_FORMAT, WRITTEN_BY: __version__, **state}
    return {**whole, DIGEST: state_digest(whole)}


def _format_number(format: Any) -> int | None:
    name, _, number = str(format).rpartition("/")
    return int(number) if name == "gradaccum.run" and number.isdigit() else None


def read_sealed(file: Path, device: torch.device) -> dict[str, Any]:
    """A sealed file (a checkpoint, a pipeline stage's part), its checksum verified; a damaged
    file is a ValueError saying so."""
    try:
        with warnings.catch_warnings():  # a damaged file's warnings would add lines
            warnings.simplefilter("ignore")
            saved = torch.load(file, weights_only=True, map_location=device)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same answer
        # torch's own message may suggest weights_only=False: never, for a file that
        # cannot be read safely. Name the file and what to do instead.
        raise ValueError(
            f"{file} cannot be read as a gradaccum checkpoint ({type(err).__name__}): it "
            "is truncated, damaged or not a checkpoint"
        ) from None
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
        theirs = _format_number(saved.get("format")) if isinstance(saved, dict) else None
        if theirs is not None and theirs > _format_number(CHECKPOINT_FORMAT):
            from gradaccum import __version__

            by = saved.get(WRITTEN_BY)
            raise NewerCheckpoint(
                f"{file} is a checkpoint of format {saved['format']}, written by "
                f"{'gradaccum ' + str(by) if by else 'a newer gradaccum'}; this gradaccum "
                f"({__version__}) reads {CHECKPOINT_FORMAT}: resume with "
                f"{'gradaccum ' + str(by) if by else 'the gradaccum that wrote it'} or newer "
                "(the run is whole: nothing to move away)"
            )
        raise ValueError(f"{file} is not a gradaccum run checkpoint")
    recorded = saved.pop(DIGEST, None)
    if recorded is not None and state_digest(saved) != recorded:
        raise ValueError(
            f"{file} is damaged: its contents do not match the checksum written with it "
            f"(step {saved.get('step', '?')})"
        )
    return saved


class Checkpoints:
    """The checkpoint files of a run folder: checkpoint.pt, and with the incident guard
    copies of the last K under checkpoints/ (step-N.pt) to roll back to and for a resume to
    fall back on."""

    def __init__(self, folder: RunFolder) -> None:
        self.folder = folder

    def exists(self) -> bool:
        return (self.folder.path / CHECKPOINT).is_file()

    def save(self, state: dict[str, Any]) -> None:
        self.folder.write_file(CHECKPOINT, lambda tmp: torch.save(sealed(state), tmp))

    def load(self, device: torch.device, file: Path | None = None) -> dict[str, Any] | None:
        """The checkpoint (checkpoint.pt, or ``file``), its checksum verified, or None when
        the run stopped before its first one. A damaged file is a ValueError saying so."""
        file = file or self.folder.path / CHECKPOINT
        if not file.exists():
            return None
        return read_sealed(file, device)

    def keep(self, step: int, keep: int) -> None:
        """Keep checkpoint.pt as checkpoints/step-N.pt, a copy of its own (damage to one file
        leaves the other whole), and only the last ``keep``."""
        kept = self.folder.path / KEPT
        target = kept / f"step-{step:08d}.pt"
        tmp = target.with_name(target.name + ".tmp")
        try:
            kept.mkdir(exist_ok=True)
            tmp.unlink(missing_ok=True)
            shutil.copyfile(self.folder.path / CHECKPOINT, tmp)
            os.replace(tmp, target)
            for _, old in self.kept()[:-keep]:
                old.unlink()
        except OSError as err:
            raise ValueError(f"cannot keep a checkpoint in {kept}: {write_failure(err)}") from None

    def kept(self) -> list[tuple[int, Path]]:
        """(step, file) of the kept checkpoints, oldest first."""
        return self.folder.kept_checkpoints()


class Checkpointer:
    """When the run checkpoints, and writing it: ``due`` says whether a window boundary
    takes one, ``save`` writes it. ``state(step, accumulator)`` is the checkpoint's body
    (``Run.state_dict``); ``kind`` writes the parts other processes hold; ``keep``: how many
    copies the guard keeps (None without the guard). On ranks that do not write, ``save``
    takes part in the kind's collective writes and writes nothing itself."""

    def __init__(
        self,
        store: Checkpoints,
        kind: Any,
        window: Any,
        state: Callable[[int, Any], dict[str, Any]],
        *,
        every: int,
        keep: int | None,
        start: int,
    ) -> None:
        self.store, self.kind, self.window, self.state = store, kind, window, state
        self.every, self.keep = every, keep
        self.last = start  # the step of the newest checkpoint this session knows of
        self.writes = kind.main

    phase = "checkpoint"

    def due(self, at: Boundary) -> bool:
        return at.last or at.step % self.every == 0

    def run(self, at: Boundary) -> None:
        self.save(at.step)

    def save(self, step: int) -> None:
        """Step ``step``'s checkpoint, every process's part, committed by checkpoint.pt; the
        parts of steps no checkpoint names any more are pruned."""
        folder = self.store.folder
        problem = None
        try:
            accumulator = self.kind.save_parts(self.window, folder, step)
            if self.writes:
                state = self.state(step, accumulator or self.window.state_dict())
                self.store.save({**state, PROCESSES: self.kind.world})
                if self.keep is not None:
                    self.store.keep(step, self.keep)
                self.kind.prune(folder, {step, *(s for s, _ in self.store.kept())})
        except ValueError as err:
            problem = self.stopped(str(err))
        # Under torchrun a write that failed on one rank (rank 0's checkpoint.pt) stops every
        # rank here, with its words: rank 0 says them once, and no rank is left waiting in
        # the next window's collective for a process that has gone.
        problem = launch.first_message(problem)
        if problem is not None:
            raise ValueError(problem)
        self.last = step

    def stopped(self, what: str) -> str:
        """``what`` went wrong writing the run folder: what is kept, and how to go on."""
        folder = self.store.folder
        if folder.removable():  # before its first step: RunFolder.abandon removes it
            return (
                f"{what}; the run stopped before its first step and its folder is removed: "
                "free the space and run the same command again"
            )
        kept = (
            f"its last checkpoint (step {self.last}) is kept"
            if self.store.exists()
            else "no checkpoint yet"
        )
        return (
            f"{what}; training stopped, {kept}; free the space and continue with: "
            f"{launch.resume_command(folder.path)}"
        )
