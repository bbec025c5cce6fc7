"""The run's exports as the run goes: every --export-every steps, at the end and when a target
is met, the model in other tools' formats (``exports.write_exports``: a LoRA adapter, a merged
or full Hugging Face model); and at the end a model held in shards gathered whole into
model.pt. Rank 0 writes; every rank takes part in gathering shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.app.boundary import Boundary
from gradaccum.app.exports import write_exports
from gradaccum.app.folder import EXPORT, MODEL, RunFolder

__all__ = ["Exporter"]


class Exporter:
    """A component (``gradaccum.app.boundary``): ``run(at)`` writes what the boundary is
    due to write. ``gather`` is the
    kind's (None where the model is whole here); ``stopped`` words a failed write."""

    def __init__(
        self,
        cfg: Any,
        folder: RunFolder,
        model: torch.nn.Module,
        kind: Any,
        log,
        stopped: Callable[[str], str],
    ) -> None:
        self.cfg, self.folder, self.model, self.kind = cfg, folder, model, kind
        self.log, self.stopped = log, stopped
        self.every = cfg.output.export_every
        self.formats = cfg.source.hf_model is not None  # a built-in recipe exports none
        self.writes = kind.main

    phase = "export"

    def due(self, at: Boundary) -> bool:
        """Whether anything is written at ``at`` (the gather of shards included)."""
        formats = self._exporting(at) and self.formats
        return formats or self.kind.gathers and self._final(at)

    def _exporting(self, at: Boundary) -> bool:
        return bool(self.every and at.step % self.every == 0 or self._final(at))

    @staticmethod
    def _final(at: Boundary) -> bool:
        """The run's model as it ends: at its last step or a target (not at a stop signal,
        which the resume goes on from)."""
        return at.end or bool(at.hit)

    def run(self, at: Boundary) -> None:
        exporting = self._exporting(at)
        final = self._final(at)
        # A model held in shards is gathered whole (every rank takes part) once, for
        # model.pt at the end and for the Hugging Face export; None where it is whole.
        whole = None
        writes = exporting and self.formats
        if final or writes:
            whole = self.kind.gather(self.model)
        if exporting and self.formats and self.writes:
            written = write_exports(self.cfg, self.model, self.folder.path / EXPORT, whole)
            if written:
                self.log("exported " + ", ".join(str(w) for w in written))
        if whole is not None and final and self.writes:
            try:
                self.folder.write_file(MODEL, lambda tmp: torch.save(whole, tmp))
            except ValueError as err:
                raise ValueError(self.stopped(str(err))) from None
            self.log(f"wrote {self.folder.path / MODEL}: the whole model, gathered from the shards")
