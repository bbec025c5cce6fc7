"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a world size, modelled from the
unsharded trace: one rank's allocation sequence, rewritten.

FSDP2 itself is not traced (its device mesh and process group do not run on fake tensors).
The unsharded window is traced as always, with marks where each ``fully_shard`` unit's
forward and backward begin and end (``Marks``); ``shard`` then rewrites the sequence as rank 0
of ``world`` would see it (rank 0 holds the largest shards), following what FSDP2 allocates
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_param_group.py,
_fsdp_collectives.py):

- Units: each repeated block (``gradaccum.recompute.repeated_blocks``, a transformer's
  layers) and the root for every other parameter, as torchtitan and ``gradaccum train
  --shard fsdp`` wrap them.
- Each parameter is held as its dim-0 shard padded to ``ceil(dim0 / world)`` rows
  (``FSDPParam._init_sharded_param``); optimizer state and the optimizer step's temporaries
  of a parameter's shape are shard-sized; buffers stay whole.
- Forward: a unit's pre-forward all-gathers into a flat output of its padded parameters and
  copies out into per-parameter outputs (the unsharded parameters); the flat output is kept
  until the next unit's copy-out (``all_gather_state``), the unsharded parameters freed after
  the unit's forward (``reshard_after_forward=True``), the root's kept until the end of
  backward (FSDP2 sets the root's to False).
- Backward: each unit's pre-backward copies out its gathered parameters and prefetches the
  previous unit's all-gather (the default backward prefetch: two units' worth at a time); its
  post-backward frees its unsharded parameters and, when the gradient is reduced, copies the
  unit's unsharded gradients into one padded reduce-scatter input (held until the next
  unit's reduce-scatter: ``reduce_scatter_max_input_buffers=1``), frees them, and makes the
  reduce-scatter output, the unit's sharded gradients (or adds it into them).
- Gradient accumulation (``gradaccum.sync``): ``"window"`` keeps every unit's unsharded
  gradient between micro-batches and reduce-scatters on the window's last; ``"micro"``
  reduce-scatters every micro-batch and accumulates the sharded gradient.

The unsharded gradients are the traced ones, held until their unit's reduce-scatter instead
of the optimizer's ``zero_grad``; a gradient made after its unit's reduce-scatter (the next
micro-batch's under ``"micro"``), which the trace added into the one it still held, is
counted from that addition on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from gradaccum.planning.estimate.trace import live_at

__all__ = ["Events", "Layout", "Marks", "layout", "shard"]

SYNCS = ("window", "micro")


def shard_numel(shape: torch.Size | tuple[int, ...], world: int) -> int:
    """Rank 0's padded dim-0 shard of a tensor of ``shape`` (FSDP2's ``chunks[0]``)."""
    if len(shape) == 0:
        return 1
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / world) * rest


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per unit (root first, then the blocks as ``repeated_blocks`` lists them): its module,
    its parameters, the bytes of its all-gathered parameters (``gathered``, padded) and of its
    trainable parameters' reduce-scatter input (``reduced``, padded)."""

    world: int
    gathered: tuple[int, ...]
    reduced: tuple[int, ...]
    modules: tuple[torch.nn.Module, ...]
    params: tuple[tuple[torch.nn.Parameter, ...], ...]


def layout(model: torch.nn.Module, world: int) -> Layout:
    from gradaccum.recompute import repeated_blocks

    blocks = repeated_blocks(model)
    owned: dict[int, int] = {}
    units: list[list[torch.nn.Parameter]] = [[] for _ in range(len(blocks) + 1)]
    for i, (_, block) in enumerate(blocks, start=1):
        for p in block.parameters():
            if id(p) not in owned:
                owned[id(p)] = i
                units[i].append(p)
    for p in model.parameters():
        if id(p) not in owned:
            owned[id(p)] = 0
            units[0].append(p)

    def padded(p: torch.nn.Parameter) -> int:
        return world * shard_numel(p.shape, world) * p.element_size()

    return Layout(
        world=world,
        gathered=tuple(sum(padded(p) for p in ps) for ps in units),
        reduced=tuple(sum(padded(p) for p in ps if p.requires_grad) for ps in units),
        modules=(model, *(b for _, b in blocks)),
        params=tuple(tuple(ps) for ps in units),
    )


class Marks:
    """Where each unit's forward and backward begin and end in the trace: ``marks`` holds
    ``(event index, what, unit, parameter)``, what one of "fwd_pre", "fwd_post", "bwd_pre",
    "grad" (a parameter's gradient accumulated), "bwd_post", "bwd_end" (the end of a
    backward, unit None); ``grads`` maps each traced gradient's serial to its unit and
    parameter. Module hooks while the trace runs; a forward during backward (activation
    checkpointing's recomputation) is not a forward."""

    def __init__(self, units: Layout, tally: Any) -> None:
        self.units, self.tally = units, tally
        self.marks: list[tuple[int, str, int | None, int | None]] = []
        self.grads: dict[int, tuple[int, int]] = {}  # a gradient's serial -> unit, parameter
        self._handles: list[Any] = []
        self._pending: dict[int, int] = {}  # unit -> its trainable grads not yet accumulated
        self._inputs: dict[int, int] = {}  # unit -> its inputs' gradients not yet computed
        self._open: set[int] = set()  # units whose backward began and did not end
        self._queued = False

    def _mark(self, what: str, unit: int | None, param: int | None = None) -> None:
        self.marks.append((len(self.tally.events), what, unit, param))

    def __enter__(self) -> Marks:
        for unit, module in enumerate(self.units.modules):
            self._handles += [
                module.register_forward_pre_hook(self._pre(unit)),
                module.register_forward_hook(self._post(unit), always_call=True),
            ]
            for i, p in enumerate(self.units.params[unit]):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad(unit, i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _backward_begins(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        self._open.clear()
        self._mark("bwd_end", None)

    def _pre(self, unit: int):
        def hook(_module, args):
            if self._in_backward() or not torch.is_grad_enabled():
                return
            self._mark("fwd_pre", unit)
            if unit == 0:
                return
            inputs = [t for t in tree_flatten(args)[0] if _grads(t)]
            self._inputs[unit] = len(inputs)
            for t in inputs:
                t.register_hook(lambda g, unit=unit: self._input_grad(unit))

        return hook

    def _post(self, unit: int):
        def hook(_module, _args, out):
            if self._in_backward() or not torch.is_grad_enabled():
                return
            self._mark("fwd_post", unit)
            self._pending[unit] = sum(p.requires_grad for p in self.units.params[unit])
            outs = [t for t in tree_flatten(out)[0] if _grads(t)]
            if not outs and unit == 0:
                outs = [t for t in _tensors(out) if _grads(t)]
            for t in outs:
                t.register_hook(lambda g, unit=unit: self._begin(unit))

        return hook

    def _begin(self, unit: int) -> None:
        self._backward_begins()
        if unit not in self._open:
            # this unit's output is the next one's input: FSDP2 ends the next unit's backward
            # (its post-backward runs on the gradient of its inputs) before this one's begins
            for other in [u for u in self._open if u and self._pending.get(u, 0) <= 0]:
                self._open.discard(other)
                self._mark("bwd_post", other)
            self._open.add(unit)
            self._mark("bwd_pre", unit)

    def _grad(self, unit: int, param: int):
        def hook(p):
            self._backward_begins()
            if unit not in self._open:  # its outputs' hook did not fire first
                self._open.add(unit)
                self._mark("bwd_pre", unit)
            serial = self.tally.record(p.grad)
            self.grads.setdefault(serial, (unit, param))
            self._mark("grad", unit, param)
            self._pending[unit] = self._pending.get(unit, 1) - 1
            self._maybe_done(unit)

        return hook

    def _input_grad(self, unit: int) -> None:
        self._inputs[unit] = self._inputs.get(unit, 1) - 1
        self._maybe_done(unit)

    def _maybe_done(self, unit: int) -> None:
        if unit == 0 or unit not in self._open:
            return  # the root's post-backward is the end of backward, as in FSDP2
        if self._pending.get(unit, 0) <= 0 and self._inputs.get(unit, 0) <= 0:
            self._open.discard(unit)
            self._mark("bwd_post", unit)


def _grads(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output that pytree does not flatten (a ``ModelOutput``)."""
    values = out.values() if isinstance(out, dict) else getattr(out, "__dict__", {}).values()
    return [v for v in values if isinstance(v, torch.Tensor)]


@dataclasses.dataclass
class Events:
    """An allocation sequence with its tags and peak, as ``Tally`` gives them."""

    events: list[tuple[str, Any, int]]
    tags: dict[Any, str]
    peak: int = 0
    peak_index: int = 0

    def __post_init__(self) -> None:
        current = 0
        for i, (action, _, size) in enumerate(self.events, start=1):
            current += size if action == "alloc" else -size
            if current > self.peak:
                self.peak, self.peak_index = current, i

    def live_at(self, index: int) -> dict[Any, int]:
        return live_at(self.events, index)


def shard(
    tally: Any,
    marks: Marks,
    units: Layout,
    params: dict[int, tuple[int, ...]],
    param_shapes: set[tuple[int, ...]],
    *,
    sync: str,
    micro_batches: int,
) -> Events:
    """Rank 0's allocation sequence under FSDP2 (see the module's docstring). ``params``:
    the traced serial of each parameter's storage -> its shape; ``param_shapes``: the
    trainable parameters' shapes, for the optimizer step's state and temporaries."""
    if sync not in SYNCS:
        raise ValueError(f"sync must be 'window' or 'micro', got {sync!r}")
    if not any(what == "fwd_pre" and unit == 0 for _, what, unit, _ in marks.marks):
        root = type(units.modules[0]).__name__
        raise ValueError(
            f"shard='fsdp': loss_fn never called the model's forward ({root}); FSDP2 gathers "
            "the root's parameters there"
        )
    world = units.world
    out: list[tuple[str, Any, int]] = []
    tags: dict[Any, str] = {}
    sizes: dict[Any, int] = {}
    serial = iter(range(1 << 62))

    def alloc(kind: str, size: int, tag: str) -> Any:
        key = ("fsdp", kind, next(serial))
        if size:
            out.append(("alloc", key, size))
            sizes[key], tags[key] = size, tag
        return key

    def free(key: Any) -> None:
        if key in sizes:
            out.append(("free", key, sizes.pop(key)))

    micro = -1
    in_step = False
    flat_held: Any = None  # FSDP2's all_gather_state: the last forward all-gather's output
    prefetched: dict[int, Any] = {}
    gathered: dict[int, Any] = {}  # unit -> its unsharded parameters
    # the unsharded gradients held: unit -> parameter -> the traced gradient or a stand-in
    unsharded: dict[int, dict[int, Any]] = {}
    sharded_grads: dict[int, Any] = {}
    rs_inputs: list[Any] = []
    order: list[int] = []  # blocks in the order their forward ended
    began: list[int] = []  # units whose backward began in this micro-batch

    def window_ends() -> bool:
        return micro % micro_batches == micro_batches - 1

    def last() -> bool:  # whether this micro-batch's backward reduce-scatters
        return sync == "micro" or window_ends()

    def gather(unit: int) -> None:
        if unit in gathered:
            return
        flat = prefetched.pop(unit, None) or alloc("all-gather", units.gathered[unit], "parameters")
        gathered[unit] = alloc("unsharded", units.gathered[unit], "parameters")
        free(flat)

    def post_backward(unit: int) -> None:
        free(gathered.pop(unit, None))
        if not last() or not unsharded.get(unit):
            return
        while rs_inputs:  # FSDP2 keeps one past its reduce-scatter, until the next one's
            free(rs_inputs.pop(0))
        rs_inputs.append(alloc("reduce-scatter input", units.reduced[unit], "gradients"))
        for key in unsharded.pop(unit).values():
            free(key)
        output = alloc("reduce-scatter output", units.reduced[unit] // world, "gradients")
        if unit in sharded_grads:
            free(output)  # added into the sharded gradient
        else:
            sharded_grads[unit] = output

    def apply(what: str, unit: int | None, param: int | None) -> None:
        nonlocal micro, in_step, flat_held
        if what == "fwd_pre":
            if unit == 0:
                micro, in_step = micro + 1, False
                order.clear()
                began.clear()
            flat = alloc("all-gather", units.gathered[unit], "parameters")
            free(flat_held)
            gathered[unit] = alloc("unsharded", units.gathered[unit], "parameters")
            flat_held = flat
        elif what == "fwd_post":
            if unit == 0:
                free(flat_held)
                flat_held = None
            else:
                free(gathered.pop(unit, None))
                order.append(unit)
        elif what == "bwd_pre":
            if 0 not in began and unit != 0:
                apply("bwd_pre", 0, None)
            began.append(unit)
            gather(unit)
            at = len(order) if unit == 0 else order.index(unit) if unit in order else 0
            if at > 0 and order[at - 1] not in gathered and order[at - 1] not in prefetched:
                target = order[at - 1]
                prefetched[target] = alloc("all-gather", units.gathered[target], "parameters")
        elif what == "grad" and param not in unsharded.get(unit, {}):
            # a gradient made after the unit's last reduce-scatter: autograd's result, which
            # the trace added into the gradient it still held (and freed)
            p = units.params[unit][param]
            size = p.numel() * p.element_size()
            unsharded.setdefault(unit, {})[param] = alloc("unsharded gradient", size, "gradients")
        elif what == "bwd_post":
            post_backward(unit)
        elif what == "bwd_end":
            for u in began:
                post_backward(u)
            for key in list(prefetched.values()):
                free(key)
            prefetched.clear()
            for key in rs_inputs:
                free(key)
            rs_inputs.clear()
            in_step = window_ends()

    zeroed = False
    at = 0
    for i, (action, key, size) in enumerate(tally.events):
        while at < len(marks.marks) and marks.marks[at][0] <= i:
            _, what, unit, param = marks.marks[at]
            if what == "fwd_pre" and unit == 0:
                zeroed = False
            apply(what, unit, param)
            at += 1
        tag = tally.tags.get(key)
        if action == "free" and tag == "gradients" and in_step and not zeroed:
            zeroed = True  # the optimizer's zero_grad: the sharded gradients go too
            for u in list(sharded_grads):
                free(sharded_grads.pop(u))
        if action == "alloc":
            if key in params:
                size = shard_numel(params[key], world) * size // max(math.prod(params[key]), 1)
            elif in_step and tally.shapes.get(key) in param_shapes:
                shape = tally.shapes[key]
                size = shard_numel(shape, world) * size // max(math.prod(shape), 1)
            elif key in marks.grads:  # an unsharded gradient, held until its reduce-scatter
                unit, param = marks.grads[key]
                unsharded.setdefault(unit, {})[param] = key
            sizes[key] = size
            if tag is not None:
                tags[key] = tag
            out.append(("alloc", key, size))
        elif key in sizes:
            out.append(("free", key, sizes.pop(key)))
    while at < len(marks.marks):
        apply(*marks.marks[at][1:])
        at += 1
    return Events(out, tags)
