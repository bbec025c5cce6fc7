"""A traced window's allocation sequence kept with its estimate, and the sequence of another
micro-batch size read off two of them, with no trace.

The ops a window runs do not depend on its micro-batch size; the bytes they allocate do,
each in one of two ways: not at all (parameters, gradients, optimizer state, a weight's
cast) or in proportion (everything that carries the batch dimension). Two traces of the same
window at sizes ``a`` and ``b`` show which (``grows``): their events must be the same
allocations and frees in the same order, and each allocation's bytes the same at both sizes
or exactly ``b / a`` times as many. Where that holds, the sequence at any size ``m`` is the
first's with each proportional allocation scaled by ``m / a`` (``at``), and replaying it
through the allocator model is what a trace at ``m`` would give. Where it does not (an op
chosen by size, a tensor whose bytes grow with the batch squared, a constant part
concatenated to a batch), there is no sequence: the size is traced. A micro-batch of one is
always traced: some of its tensors are laid out otherwise (a transpose of a dimension of 1
is already contiguous, so no copy is made), so its sequence is not the others'.

A sequence length changes the bytes too, in more ways (in proportion, squared in an
attention matrix, plus one in a shifted label), but the same way in every repeated block:
``resized`` reads a whole model's sequence at another length off two traces of a smaller
model of the same blocks at the two lengths. Their events must be the same, and each
allocation of a kind and size at the first length must become one size at the second (a
table from size to size); the whole model's allocations are changed by that table. An
activation of a size the smaller model never made is not read (the table would not know
it); a temporary of such a size is one of the whole model's own (a buffer over all its
parameters) and keeps its bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Stream"]

# an allocation's kind (``Tally.tags``) as one letter; "t": untagged, a temporary
_KINDS = {
    "parameters": "p",
    "gradients": "g",
    "optimizer state": "o",
    "activations": "a",
}
_NAMES = {v: k for k, v in _KINDS.items()}


@dataclasses.dataclass(frozen=True)
class Stream:
    """One traced window's allocations and frees at ``micro_size`` (``estimate(keep=True)``),
    with what replaying it needs: the serials that stay on the host, the paged bytes outside
    the allocator and the trace's own assumptions."""

    micro_size: int
    sizes: tuple[int, ...]
    """Allocation ``i``'s bytes (its serial is ``i``)."""
    kinds: str
    """Allocation ``i``'s kind: a letter of ``_KINDS``, "t" for a temporary."""
    order: str
    """Each event in turn: "a" (the next allocation) or "f" (a free, in ``frees``)."""
    frees: tuple[int, ...]
    host: tuple[int, ...]
    unified: int
    assumptions: tuple[str, ...]
    allocator: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The allocator model's settings it was replayed with (``AllocatorConfig``'s fields)."""
    shapes: tuple[str, ...] = ()
    """Allocation ``i``'s op and tensor shape as traced ("mm.default:128x32"; "s" for a
    scalar), what ``resized`` tells allocations apart by; empty where the sequence was
    read, not traced."""

    @classmethod
    def of(
        cls, tally: Any, micro_size: int, host, unified: int, assumptions, allocator=None
    ) -> Stream | None:
        """``tally``'s sequence, or None where its serials are not its allocations' order."""
        sizes, order, frees = [], [], []
        for action, serial, size in tally.events:
            if action == "alloc":
                if serial != len(sizes):
                    return None
                sizes.append(size)
                order.append("a")
            else:
                frees.append(serial)
                order.append("f")
        kinds = "".join(_KINDS.get(tally.tags.get(i), "t") for i in range(len(sizes)))
        ops = getattr(tally, "ops", {})
        shapes = tuple(f"{ops.get(i, '')}:{_shape(tally.shapes.get(i))}" for i in range(len(sizes)))
        return cls(
            micro_size=micro_size,
            sizes=tuple(sizes),
            kinds=kinds,
            order="".join(order),
            frees=tuple(frees),
            host=tuple(sorted(s for s in host if isinstance(s, int))),
            unified=unified,
            assumptions=tuple(assumptions),
            allocator=dataclasses.asdict(allocator) if allocator is not None else {},
            shapes=shapes,
        )

    def events(self) -> list[tuple[str, int, int]]:
        """The ``(action, serial, bytes)`` sequence, as ``Tally.events``."""
        out, made, freed = [], 0, iter(self.frees)
        for action in self.order:
            if action == "a":
                out.append(("alloc", made, self.sizes[made]))
                made += 1
            else:
                serial = next(freed)
                out.append(("free", serial, self.sizes[serial]))
        return out

    def tags(self) -> dict[int, str]:
        return {i: _NAMES[k] for i, k in enumerate(self.kinds) if k in _NAMES}

    def same_window(self, other: Stream) -> bool:
        """Whether ``other`` is this window's sequence (the same allocations and frees in
        the same order, of the same kinds), whatever its sizes."""
        fields = ("order", "frees", "kinds", "host", "unified", "allocator")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def grows(self, other: Stream) -> str | None:
        """Which allocations grow with the micro-batch, read off ``other`` (the same window
        at another size, both at least 2): "=" for one of the same bytes at both, "*" for
        one in proportion to the size; None where an allocation is neither, or the windows
        are not the same."""
        a, b = self.micro_size, other.micro_size
        if a == b or min(a, b) < 2 or not self.same_window(other):
            return None
        out = []
        for x, y in zip(self.sizes, other.sizes, strict=True):
            if x == y:
                out.append("=")
            elif x * b == y * a:
                out.append("*")
            else:
                return None
        return "".join(out)

    def at(self, micro_size: int, grows: str) -> Stream | None:
        """This sequence at ``micro_size`` (at least 2), its allocations that ``grows``
        marks "*" scaled with it; None where one would not be whole bytes."""
        if micro_size < 2 or self.micro_size < 2 or len(grows) != len(self.sizes):
            return None
        sizes = []
        for x, how in zip(self.sizes, grows, strict=True):
            if how == "*":
                if (x * micro_size) % self.micro_size:
                    return None
                x = x * micro_size // self.micro_size
            sizes.append(x)
        return dataclasses.replace(self, micro_size=micro_size, sizes=tuple(sizes), shapes=())

    def resized(
        self, before: Stream, after: Stream, grows: tuple[str, str] | None = None
    ) -> Stream | None:
        """This sequence (a model of repeated blocks) at another sequence length: each
        allocation changed as ``before`` -> ``after`` (a smaller model of the same blocks
        traced at this sequence's length and at the other, at this micro-batch size) changed
        the allocations of its kind, op, shape and bytes, and, given ``grows`` (``grows()``
        of this sequence and of ``before`` against themselves at another size), whether it
        grows with the micro-batch: a LoRA weight's (4096, 16) gradient and the (4096, 16)
        product of 2 x 2,048 tokens are told apart by that alone. None where the two are not
        the same window, such an allocation becomes two sizes, or an activation is not among
        theirs."""
        sizes = {self.micro_size, before.micro_size, after.micro_size}
        traced = all(len(s.shapes) == len(s.sizes) for s in (self, before))
        if len(sizes) != 1 or not traced or not before.same_window(after):
            return None
        if self.allocator != before.allocator:
            return None
        mine, theirs = grows or ("=" * len(self.sizes), "=" * len(before.sizes))
        if len(mine) != len(self.sizes) or len(theirs) != len(before.sizes):
            return None
        table: dict[tuple[str, str, int, str], int] = {}
        keys = zip(before.kinds, before.shapes, before.sizes, theirs, strict=True)
        for key, y in zip(keys, after.sizes, strict=True):
            if table.setdefault(key, y) != y:
                return None
        out = []
        for key in zip(self.kinds, self.shapes, self.sizes, mine, strict=True):
            y = table.get(key)
            if y is None and key[0] == "a":
                return None
            out.append(key[2] if y is None else y)
        return dataclasses.replace(self, sizes=tuple(out), shapes=())

    def to_dict(self) -> dict[str, Any]:
        """Text, short and quick to read back: the sizes and frees as comma-separated
        integers."""
        return {
            "micro_size": self.micro_size,
            "sizes": ",".join(map(str, self.sizes)),
            "kinds": self.kinds,
            "order": self.order,
            "frees": ",".join(map(str, self.frees)),
            "host": list(self.host),
            "unified": self.unified,
            "assumptions": list(self.assumptions),
            "allocator": dict(self.allocator),
            "shapes": ",".join(self.shapes),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Stream:
        """A stored sequence; ValueError (what is wrong) for one that is not whole."""
        if not isinstance(data, dict):
            raise ValueError("its allocation sequence is not a table")
        try:
            sizes = tuple(int(x) for x in data["sizes"].split(",") if x)
            frees = tuple(int(x) for x in data["frees"].split(",") if x)
            kinds, order = str(data["kinds"]), str(data["order"])
            out = cls(
                micro_size=int(data["micro_size"]),
                sizes=sizes,
                kinds=kinds,
                order=order,
                frees=frees,
                host=tuple(int(x) for x in data["host"]),
                unified=int(data["unified"]),
                assumptions=tuple(str(x) for x in data["assumptions"]),
                allocator=dict(data.get("allocator", {})),
                shapes=tuple(x for x in str(data.get("shapes", "")).split(",") if x),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"its allocation sequence is damaged ({err})") from None
        allocs = order.count("a")
        whole = (
            out.micro_size >= 1
            and len(sizes) == len(kinds) == allocs
            and len(frees) == len(order) - allocs
            and set(order) <= {"a", "f"}
            and set(kinds) <= {*_NAMES, "t"}
            and all(x >= 0 for x in sizes)
            and len(out.shapes) in (0, len(sizes))
            and _frees_follow(order, frees)
        )
        if not whole:
            raise ValueError("its allocation sequence is damaged (its counts do not agree)")
        return out


def _shape(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "?"
    return "x".join(map(str, shape)) if shape else "s"


def _frees_follow(order: str, frees: tuple[int, ...]) -> bool:
    """Whether each free is of an allocation made before it, freed once."""
    made, done, freed = 0, set(), iter(frees)
    for action in order:
        if action == "a":
            made += 1
            continue
        serial = next(freed)
        if not 0 <= serial < made or serial in done:
            return False
        done.add(serial)
    return True
