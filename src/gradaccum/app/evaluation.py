"""The held-out evaluation: every --eval-every steps, at the run's end and when a cost limit
is reached (so the stop's numbers are current), on the processes that evaluate (rank 0, or
every rank where evaluation is collective: a pipeline's stages, FSDP2's ranks)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Evaluator"]


class Evaluator:
    """``due`` says whether a step evaluates; ``evaluate`` runs the recipe's held-out
    evaluation on the module the kind evaluates with, at ``size`` samples a forward. On a
    process that does not evaluate, nothing is due and ``final`` returns None."""

    def __init__(self, kind: Any, data: Any, model: torch.nn.Module, size: int, every: int):
        self.kind, self.data, self.model, self.size, self.every = kind, data, model, size, every
        self.active = kind.evaluates()

    def due(self, step: int, *, end: bool, limit: bool) -> bool:
        return self.active and (step % self.every == 0 or end or limit)

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics, by the recipe's names (loss, accuracy, ...)."""
        return self.data.evaluate(self.kind.evaluated(self.model), self.size)

    def final(self, last_line: dict[str, Any] | None) -> dict[str, float] | None:
        """The held-out metrics at the run's last step: its last metrics line's (``last_line``,
        rank 0's), or evaluated now when it has none (nothing trained, a stop on a signal, or
        the guard stopped at a rollback). Rank 0 returns them, the others None; processes
        that evaluate together all call it."""
        if not self.active:
            return None
        known = {k[5:]: v for k, v in (last_line or {}).items() if k.startswith("eval_")}
        known = self.kind.agree(known)
        if not known:
            known = self.evaluate()
        return known if self.kind.main else None
