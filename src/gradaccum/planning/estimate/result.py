"""``Estimate``: the peak memory of a training window on a device that is not here."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradaccum.memory import format_bytes
from gradaccum.planning.estimate.stream import Stream

__all__ = ["PARTS", "Estimate"]

# what the allocated peak is made of, in the order they are shown
PARTS = (
    "parameters",
    "gradients",
    "optimizer state",
    "activations",
    "temporaries",
    "allocator rounding",
)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One window's peak memory, traced with fake tensors (``ga.estimate``).

    ``allocated``: what ``torch.cuda.max_memory_allocated()`` would report (each tensor rounded
    to the caching allocator's blocks); ``reserved``: what ``max_memory_reserved()`` would
    (the sequence replayed through a model of the allocator); ``total``: reserved plus the CUDA
    context and any paged optimizer state (what nvidia-smi would show). On ``device="cpu"``
    (the check of the trace against a real run) ``allocated`` is the live tensor bytes' peak
    and the other two equal it.
    ``parts``: the allocated peak by what it holds, at the moment of the peak."""

    device: str
    gpu: str | None
    micro_size: int | None
    micro_batches: int
    allocated: int
    reserved: int
    total: int
    tensor_peak: int
    parts: dict[str, int]
    assumptions: tuple[str, ...]
    context: int = 0
    unified: int = 0
    """Paged optimizer state in CUDA unified memory, outside the caching allocator (in
    ``total``, not in ``allocated`` or ``reserved``)."""
    seconds: float = 0.0
    sync: str | None = None
    """Under FSDP2 (``shard="fsdp"``): the gradient sync modelled, "window" or "micro"."""
    steady: bool = False
    """Whether the second window's events were the first's repeated (``estimate(repeat=
    True)`` is then right for this training at another size)."""
    stream: Stream | None = dataclasses.field(default=None, repr=False, compare=False)
    """The traced allocation sequence (``estimate(keep=True)``), for ``at_size``."""

    def fits(self, budget: int) -> bool:
        """Whether the device total stays within ``budget`` bytes."""
        return self.total <= budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimate": True,
            "device": self.device,
            "gpu": self.gpu,
            "micro_batch": self.micro_size,
            "per_window": self.micro_batches,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "total": self.total,
            "context": self.context,
            "unified": self.unified,
            "tensor_peak": self.tensor_peak,
            "parts": dict(self.parts),
            "assumptions": list(self.assumptions),
            "seconds": round(self.seconds, 3),
            "steady": self.steady,
            **({"sync": self.sync} if self.sync else {}),
            **({"stream": self.stream.to_dict()} if self.stream is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        """An estimate ``to_dict()`` wrote; ValueError (what is wrong) for one it did not."""
        try:
            stream = data.get("stream")
            return cls(
                device=str(data["device"]),
                gpu=data["gpu"],
                micro_size=data["micro_batch"],
                micro_batches=int(data["per_window"]),
                allocated=int(data["allocated"]),
                reserved=int(data["reserved"]),
                total=int(data["total"]),
                tensor_peak=int(data["tensor_peak"]),
                parts={str(k): int(v) for k, v in data["parts"].items()},
                assumptions=tuple(str(a) for a in data["assumptions"]),
                context=int(data.get("context", 0)),
                unified=int(data.get("unified", 0)),
                seconds=float(data.get("seconds", 0.0)),
                sync=data.get("sync"),
                steady=bool(data.get("steady", False)),
                stream=None if stream is None else Stream.from_dict(stream),
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"is not an estimate ({type(err).__name__}: {err})") from None

    def table(self) -> str:
        rows = [("allocated (max_memory_allocated)", self.allocated)]
        rows += [(f"  {name}", size) for name, size in self.parts.items()]
        rows += [("reserved (max_memory_reserved)", self.reserved)]
        if self.device == "cuda":
            rows += [("  CUDA context (assumed)", self.context)]
        if self.unified:
            rows += [("  paged optimizer state (unified memory)", self.unified)]
        rows += [("device total", self.total)]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {format_bytes(size):>10}" for name, size in rows)

    def summary(self) -> str:
        shape = (
            f"micro-batch {self.micro_size} x {self.micro_batches} per window"
            if self.micro_size is not None
            else f"{self.micro_batches} micro-batches per window"
        )
        where = f"{self.device} ({self.gpu})" if self.gpu else self.device
        lines = [
            f"estimate for {where}, {shape}: {format_bytes(self.total)} on the device "
            f"(allocated {format_bytes(self.allocated)}, reserved {format_bytes(self.reserved)}); "
            "traced with fake tensors, not measured",
        ]
        lines += [f"assumed: {a}" for a in self.assumptions]
        return "\n".join(lines)
