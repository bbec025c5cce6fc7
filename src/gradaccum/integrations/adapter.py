"""What a framework's audit adapter hands ``gradaccum.audit``: one window to audit
(``AuditWindow``). It lives here, below both, so that the audit (which dispatches to each
framework's adapter) and the adapters (which build it) do not import each other."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["AuditWindow"]


@dataclass(frozen=True)
class AuditWindow:
    """One window to audit, as a framework's adapter (or a plain loop) builds it.

    ``run()`` accumulates the window's gradient the trainer's own way, without stepping;
    ``big()`` is the same samples as one batch under the trainer's own loss, a mean;
    ``equal()`` the micro-batches' own means averaged with equal weights. ``micro_batches``:
    the window's, or a function that tells them once it has run. ``scaled``: a function,
    called after the run, of the known causes that scale the gradient by a known factor,
    as ``{cause name: factor}`` (a Trainer that divided by labels counted before the shift:
    the shifted count over its count). ``fixes``: cause name -> what to do, one line with a
    doc link, in this framework's terms (``FIXES`` names the causes)."""

    model: nn.Module
    run: Callable[[], None]
    big: Callable[[], torch.Tensor]
    equal: Callable[[], torch.Tensor]
    micro_batches: int | Callable[[], int]
    fixes: Mapping[str, str] = field(default_factory=dict)
    scaled: Callable[[], Mapping[str, float]] | None = None
