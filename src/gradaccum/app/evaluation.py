"""The held-out evaluation: every --eval-every steps, at the run's end and when a cost limit
is reached (so the stop's numbers are current), on the processes that evaluate (rank 0, or
every rank where evaluation is collective: a pipeline's stages, FSDP2's ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.app.boundary import Boundary

__all__ = ["Evaluator"]


class Evaluator:
    """``due`` says whether a step evaluates; ``evaluate`` runs the recipe's held-out
    evaluation on the module the kind evaluates with, at ``size`` samples a forward. On a
    process that does not evaluate, nothing is due and ``final`` returns None."""

    def __init__(
        self,
        kind: Any,
        data: Any,
        model: torch.nn.Module,
        size: int,
        every: int,
        stopped: Callable[[], bool] = lambda: False,
    ):
        self.kind, self.data, self.model, self.size, self.every = kind, data, model, size, every
        self.active = kind.evaluates()
        # a stop signal abandons an evaluation in progress, where one process evaluates
        # alone (processes that evaluate together must end it together)
        self.stopped = stopped if not getattr(kind, "together", False) else lambda: False
        self.owed = False  # one evaluation owed at the next step (a resume after a stop)

    def due(self, at: Boundary) -> bool:
        owed, self.owed = self.owed, False
        return self.active and (owed or at.step % self.every == 0 or at.end or at.limit)

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics, by the recipe's names (loss, accuracy, ...); none where a
        stop signal came before or during it: the evaluation is abandoned at the next
        forward, so the stop's checkpoint comes in seconds, not after the whole held-out
        set (a scheduler's grace period ends in SIGKILL)."""
        model = self.kind.evaluated(self.model)
        if self.stopped():
            return {}

        def check(_module: Any, _args: Any) -> None:
            if self.stopped():
                raise _Abandoned

        hook = model.register_forward_pre_hook(check)
        try:
            return self.data.evaluate(model, self.size)
        except _Abandoned:
            return {}
        finally:
            hook.remove()

    def final(
        self, last_line: dict[str, Any] | None, signal: bool = False
    ) -> dict[str, float] | None:
        """The held-out metrics at the run's last step: its last metrics line's (``last_line``,
        rank 0's), or evaluated now when it has none (nothing trained, or the guard stopped at
        a rollback). After a stop on a signal (``signal``) none are evaluated: the resume
        evaluates. Rank 0 returns them, the others None; processes that evaluate together
        all call it."""
        if not self.active:
            return None
        known = {k[5:]: v for k, v in (last_line or {}).items() if k.startswith("eval_")}
        known = self.kind.agree(known)
        if not known and not signal:
            known = self.evaluate()
        return known if self.kind.main else None


class _Abandoned(Exception):  # noqa: N818 - not an error: a stop signal during evaluation
    pass
