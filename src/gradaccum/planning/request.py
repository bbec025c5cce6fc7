"""What a plan is asked: ``PlanRequest``, the settings of ``plan()`` as one small record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from gradaccum.memory import METERS, parse_bytes
from gradaccum.planning.speed import PREFER
from gradaccum.sync import SYNC_MODES
from gradaccum.validate import int_problem

__all__ = ["CHECKPOINTING", "PREFER", "PlanRequest"]

CHECKPOINTING = ("off", "on", "auto")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The settings of one plan. ``plan(model, optimizer, sample, loss_fn, request)``, or the
    same fields as ``plan()``'s keywords (``effective_batch=256, budget="2GiB"``)."""

    effective_batch: int
    """samples per optimizer step, over all ranks"""
    budget: int | str
    """bytes, or a string such as "2GiB" or "1500MB": on CUDA the allocator's peak, on CPU
    the resident memory of training (parameters, buffers, optimizer state, and what the
    process's RSS grows by while it trains)"""
    world_size: int = 1
    """the ranks the effective batch is split over (each plans ``effective_batch /
    world_size``)"""
    margin: float = 0.15
    """the fraction of the budget kept free for what the measurement cannot see: on CPU,
    fresh runs of the same training peak several percent apart (glibc's heap layout)"""
    probe_sizes: Sequence[int] | None = None
    """micro-batch sizes to measure (default 1, 2, 4, 8, capped by the per-rank batch)"""
    checkpointing: str = "off"
    """"off", "on" (checkpoint the model's repeated blocks) or "auto" (only if nothing fits
    without)"""
    precision: str = "fp32"
    """the autocast precision the probes run under: "fp32", "bf16" or "fp16\""""
    accumulate_dtype: Any = "auto"
    """``Precision``'s accumulate_dtype, as training will run"""
    meter: str = "auto"
    """"auto" (CUDA's allocator on a GPU, resident memory on CPU), "rss", or "tensors" (live
    tensor bytes: deterministic, blind to the allocator's own overheads)"""
    sync: str = "window"
    """for a DDP or FSDP2 model, the gradient sync the probes run under, or "auto": under
    FSDP2 both measured, "window" chosen when it fits, else "micro\""""
    prefer: str = "fastest"
    """"fastest": among the sizes that fit, the one with the fewest seconds per effective
    batch, timed over real windows (the largest when timing cannot tell them apart);
    "largest": the largest that fits, untimed"""

    @classmethod
    def of(cls, *args: Any, **settings: Any) -> PlanRequest:
        """``plan()``'s request from what it was given: a ``PlanRequest`` (``settings`` then
        replace its fields), or the fields as keywords."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"plan() got an unexpected keyword argument {unknown[0]!r}")
        if len(args) == 1 and isinstance(args[0], cls):
            return replace(args[0], **settings)
        if args:
            raise TypeError(
                f"plan() takes its settings by keyword or as one PlanRequest after loss_fn, "
                f"got {len(args)} more positional argument{'s' if len(args) > 1 else ''} "
                f"({', '.join(repr(a) for a in args[:3])}): write effective_batch=..., "
                "budget=... (the positional form went in gradaccum 0.8)"
            )
        missing = [name for name in ("effective_batch", "budget") if name not in settings]
        if missing:
            raise TypeError(
                f"plan() missing the setting {' and '.join(map(repr, missing))}: pass it by "
                "keyword or a PlanRequest"
            )
        return cls(**settings)

    @property
    def per_rank(self) -> int:
        return self.effective_batch // self.world_size

    def budget_bytes(self) -> int:
        return parse_bytes(self.budget)

    def problems(self) -> list[str]:
        """Every setting that is not one ``plan()`` can use, each in a line naming it."""
        out: list[str] = []
        if self.sync not in (*SYNC_MODES, "auto"):
            out.append(f"sync must be one of {', '.join([*SYNC_MODES, 'auto'])}, got {self.sync!r}")
        for name in ("effective_batch", "world_size"):
            if (problem := int_problem(getattr(self, name), name)) is not None:
                out.append(problem)
        try:
            self.budget_bytes()
        except ValueError as err:
            out.append(f"budget: {err}")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            out.append(f"margin must be a fraction in [0, 1), got {margin!r}")
        if self.meter not in METERS:
            out.append(f"meter must be one of {', '.join(METERS)}, got {self.meter!r}")
        if self.prefer not in PREFER:
            out.append(f"prefer must be one of {', '.join(PREFER)}, got {self.prefer!r}")
        if self.checkpointing not in CHECKPOINTING:
            out.append(
                f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got "
                f"{self.checkpointing!r}"
            )
        if not out and self.effective_batch % self.world_size:
            b, w = self.effective_batch, self.world_size
            out.append(
                f"effective_batch {b} does not divide over world_size {w} ranks ({b} = {w} x "
                f"{b // w} + {b % w}); choose a multiple of {w}"
            )
        if self.probe_sizes is not None:
            sizes = sorted(set(self.probe_sizes))
            bad = [s for s in sizes if int_problem(s, "a probe size") is not None]
            if bad or len(sizes) < 2:
                out.append(
                    "probe_sizes must be two or more different integers >= 1, got "
                    f"{list(self.probe_sizes)}"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["probe_sizes"] is not None:
            out["probe_sizes"] = list(out["probe_sizes"])
        return out
