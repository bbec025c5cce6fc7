"""The end of a window as the trainer's components see it: one record, the same for each
(``Boundary``), and one contract (``Component``): ``due(at)`` says whether the component
acts at this boundary, ``run(at)`` acts. The loop builds the record once and asks each
component in turn; a component reads only the fields it cares about, so adding one (an
early-stopping rule, a sink that uploads, a checkpoint to a second place) touches neither
the loop nor the others: ``Trainer(run, components=[...])``."""

from __future__ import annotations

import dataclasses
from typing import Protocol

__all__ = ["Boundary", "Component"]


@dataclasses.dataclass
class Boundary:
    """Step ``step`` just ended. ``end``: the run's last step; ``limit``: a time or memory
    limit is reached here. After the evaluation and the step's line: ``hit``, the target or
    limit the run stops at here (None: none), and ``stopping``, a stop signal every process
    agreed on."""

    step: int
    end: bool
    limit: bool
    hit: str | None = None
    stopping: bool = False

    @property
    def last(self) -> bool:
        """Whether the run ends at this boundary, for any reason, a stop signal included
        (what a checkpoint is due on; the exports' end is ``end`` or ``hit`` alone: a
        stopped run goes on when resumed)."""
        return self.end or bool(self.hit) or self.stopping


class Component(Protocol):
    """What the loop runs after a step's line is written, in the order given: ``phase``
    names the memory phase its work is counted in (memory.json)."""

    phase: str

    def due(self, at: Boundary) -> bool: ...

    def run(self, at: Boundary) -> None: ...
