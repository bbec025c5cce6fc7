"""Gradient communication for a data-parallel model, once per window. All of it lives here.

The Accumulator asks this module whether the model is wrapped for data parallelism
(``DistributedDataParallel``, or FSDP2's ``fully_shard``), whether a micro-batch's backward
communicates, how to make the window's totals global, the global gradient norm, and how to
pad a rank that holds fewer micro-batches than the others.

Why the last micro-batch communicates and the others do not: DDP all-reduces (and FSDP2
reduce-scatters) gradients inside backward, overlapped with the computation. Suppressing it
on every micro-batch but the window's last one leaves exactly one reduction per optimizer
step, and that one still overlaps with the last backward. The summed gradient is linear, so
reducing the sum once equals reducing every micro-batch's part.

Why a forward must run inside ``micro_batch()``: DDP decides in its forward whether the
backward that follows communicates. A loss computed outside the context and backpropagated
inside would reduce on the wrong micro-batch and leave the ranks' gradients different, so
the Accumulator refuses it.

Why the counts are all-reduced: the window's gradient is divided by the items of the whole
*global* batch, and ranks hold different numbers of items (padding, a ragged end). One
all-reduce of ``[count, loss sum]`` per window gives every rank the same divisor. DDP and
FSDP2 average gradients over ranks, so the divisor is the global count over the world size.

When the window's sums do not live in ``.grad`` for the whole window, DDP's reduction inside
the last backward would miss them, so under DDP the Accumulator reduces the window's sums
itself, once, at the window's end (``reduce_at_end``): with fp32 accumulation buffers for
low-precision parameters (the reduction then sums fp32 buffers, the window's whole sum), and
with OOM replay (no collective runs inside a micro-batch, so a rank that runs out of memory
midway leaves nothing for the others to wait on; one small all-reduce after the window says
whether any rank did, and all of them replay it). The price is that this one reduction no
longer overlaps the last backward. Under FSDP2 every forward gathers parameters across
ranks, so a rank cannot leave a micro-batch midway: OOM replay is refused there, and fp32
accumulation is FSDP2's own ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, which
accumulates the unsharded gradient in fp32 between micro-batches and reduce-scatters it so.

``sync="window"`` (the default) reduces once per window. ``sync="micro"`` reduces every
micro-batch: under FSDP2 the gradient then stays sharded between micro-batches (one shard of
every gradient held, against a whole unsharded gradient with ``"window"``) at the price of N
reduce-scatters per step; under DDP it only costs communication and exists for comparisons.

Why wrappers are seen through: a model often reaches the Accumulator inside another
framework's module (Lightning Fabric's ``_FabricModule``, torch.compile's ``OptimizedModule``,
PEFT's ``PeftModel``) with the DDP or FSDP2 module one or more levels down. Taken at face
value it is one process's model: every micro-batch would reduce and the count would be this
rank's alone. ``Sync.of`` follows the wrappers it knows, by their real class, down to the DDP
or FSDP2 module whose sync it controls; the forward still goes through the module the user
calls, and the forward count proves that it reached the DDP module. A module of a class it
does not know that holds a DDP or FSDP2 module is refused: what its forward does with that
module cannot be known.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradaccum.batching import map_tensors
from gradaccum.window import total_norm

# FSDP2's module class, imported only once something else has imported FSDP: importing it
# costs more than a second, and a model can be wrapped by fully_shard only after its module
# was imported (torch.distributed.fsdp from torch 2.6, torch.distributed._composable.fsdp in
# 2.4 and 2.5, which the package supports).
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _is_fsdp(model: Any) -> bool:
    if not any(name in sys.modules for name in _FSDP_MODULES):
        return False  # nothing imported FSDP: no model is wrapped by it
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


# Wrappers that run a module held under another name: (the module their class lives in, the
# class, the attribute holding the module their forward calls). A class counts only where its
# framework is already imported (sys.modules): gradaccum imports no framework, and a model
# cannot be an instance of a class whose module was never imported. Subclasses count
# (PeftModelForCausalLM, LoraModel).
_WRAPPERS = (
    ("lightning.fabric.wrappers", "_FabricModule", "_forward_module"),
    ("lightning_fabric.wrappers", "_FabricModule", "_forward_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("peft.peft_model", "PeftModel", "base_model"),
    ("peft.tuners.tuners_utils", "BaseTuner", "model"),
)

# Modules that reduce gradients across processes in a way this module does not control:
# (the module their class lives in, the class, why and what to do instead).
_REFUSED = (
    (
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel",
        "FSDP1's gradient sync is not one gradaccum controls; shard the model with "
        "torch.distributed.fsdp.fully_shard (FSDP2) instead",
    ),
    (
        "deepspeed.runtime.engine",
        "DeepSpeedEngine",
        "DeepSpeed reduces and normalizes the accumulated gradient itself; use its own "
        "accumulation (ga.plan(...).export('deepspeed') gives the batch shape)",
    ),
)


def _class(module_name: str, class_name: str) -> type | None:
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None


def _wrapped(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a known wrapper's forward calls, or None for any other module."""
    for module_name, class_name, attribute in _WRAPPERS:
        cls = _class(module_name, class_name)
        if cls is not None and isinstance(model, cls):
            inner = getattr(model, attribute, None)
            if isinstance(inner, torch.nn.Module):
                return inner
    return None


def _distributed(model: torch.nn.Module) -> str | None:
    """The class name of a module that reduces gradients across processes, or None."""
    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel"
    if _is_fsdp(model):
        return f"fully_shard's {type(model).__name__}"
    for module_name, class_name, _ in _REFUSED:
        cls = _class(module_name, class_name)
        if cls is not None and isinstance(model, cls):
            return class_name
    return None


def _unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module | None, tuple[str, ...]]:
    """The DDP or FSDP2 module that ``model`` is or holds through known wrappers, and those
    wrappers' class names, outermost first; ``(None, ())`` for a model that is not
    distributed. A refused kind (FSDP1, DeepSpeed), or a module of unknown class holding a
    distributed module, raises ValueError in one line."""
    via: list[str] = []
    current = model
    while _distributed(current) is None:
        inner = _wrapped(current)
        if inner is None:
            break
        via.append(type(current).__name__)
        current = inner
    where = f" (inside {' > '.join(via)})" if via else ""
    kind = _distributed(current)
    if kind is None:
        for name, sub in current.named_modules():
            held = _distributed(sub) if name else None
            if held is not None:
                raise ValueError(
                    f"{type(current).__name__}{where} holds a {held} module at {name!r} and "
                    "is not a wrapper gradaccum can see through (Lightning Fabric's, "
                    "torch.compile's, PEFT's): its forward may not run that module's gradient "
                    f"sync; hand the Accumulator the {held.split()[-1]} module itself or a "
                    "known wrapper of it"
                )
        return None, ()
    for _, class_name, why in _REFUSED:
        if kind == class_name:
            raise ValueError(f"the model is a {class_name}{where}: {why}")
    return current, tuple(via)


class LocalModelWarning(UserWarning):
    """A model that is not distributed, handed over in a process group of several
    processes: each process steps on its own items alone."""


_ONE_PROCESS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "gradaccum_one_process", default=False
)


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """Inside it (or a function it decorates), a model that is not distributed is one
    process's on purpose, even in an initialised process group of several processes: rank
    0 planning a micro-batch for all of them, ``ga.check`` on one rank, or ranks that each
    train a model of their own. Outside it, such a model gives a ``LocalModelWarning``."""
    token = _ONE_PROCESS.set(True)
    try:
        yield
    finally:
        _ONE_PROCESS.reset(token)


def _warn_if_not_distributed(model: torch.nn.Module) -> None:
    """A model that is not distributed where other processes are: legitimate (evaluation,
    ranks that each train their own model, rank 0 planning), so a warning, not a refusal;
    Python's default filter shows it once per place the model is handed over."""
    if _ONE_PROCESS.get() or not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if world > 1:
        warnings.warn(
            f"{type(model).__name__} is not distributed (no DistributedDataParallel or "
            f"fully_shard in it) in a process group of {world} processes: each process steps "
            "on its own items and count alone; wrap it in DistributedDataParallel or "
            "fully_shard, or hand it over inside `with gradaccum.sync.one_process():` where "
            "each process trains on its own on purpose",
            LocalModelWarning,
            stacklevel=4,  # this function, Sync.of, the Accumulator, the user's line
        )


__all__ = [
    "SYNC_MODES",
    "DDPSync",
    "FSDPSync",
    "LocalModelWarning",
    "PipelineSync",
    "Sync",
    "collective_device",
    "is_sharded",
    "one_process",
]

SYNC_MODES = ("window", "micro")


class Sync:
    """Gradient-sync control for one model; this class is one process's, which communicates
    nothing. ``Sync.of(model)`` gives the one for a model as it is wrapped: ``DDPSync``,
    ``FSDPSync``, or this; ``PipelineSync`` serves a pipeline's stages. Each kind is a class:
    nothing outside this module asks which kind it has."""

    name = "local"  # for messages
    distributed = False  # other processes take part in the window
    sharded = False  # each rank holds shards of the parameters (FSDP2)

    def __init__(self, model: torch.nn.Module | None, mode: str = "window") -> None:
        if mode not in SYNC_MODES:
            raise ValueError(
                f"sync must be one of {', '.join(map(repr, SYNC_MODES))}, got {mode!r}"
            )
        self.mode, self.model, self.inner, self.group = mode, model, model, None
        self.world = 1  # what the reduction averages the gradient over
        self.ranks = 1  # the processes the window's numbers are summed over
        self.rank = 0  # this process's place among them
        self.reduce_at_end = False  # DDP: the Accumulator reduces the window's sums (configure)
        self.via: tuple[str, ...] = ()  # the wrappers seen through to reach ``model``

    @staticmethod
    def of(model: torch.nn.Module, mode: str = "window") -> Sync:
        """The Sync for ``model`` as it is wrapped: DDP, FSDP2's fully_shard, or neither,
        seen through the wrappers gradaccum knows (Lightning Fabric's, torch.compile's,
        PEFT's, at any depth). A module of unknown class holding a DDP or FSDP2 module, or
        FSDP1 or DeepSpeed's engine, is refused (ValueError); a model that is not
        distributed in a process group of several processes gives a LocalModelWarning."""
        found, via = _unwrap(model)
        if found is None:
            _warn_if_not_distributed(model)
            return Sync(model, mode)
        sync: _Collective
        if isinstance(found, DistributedDataParallel):
            sync = DDPSync(found, mode)
        else:
            sync = FSDPSync(found, mode)
        if via:
            sync.called_through(model, via)
        return sync

    def __repr__(self) -> str:
        via = f", via={' > '.join(self.via)}" if self.via else ""
        return f"Sync({self.name}, mode={self.mode!r}, world={self.world}{via})"

    def configure(self, precision: Any, oom: Any, noise: Any) -> None:
        """Decide where the window's gradient is reduced (``reduce_at_end``), and refuse what
        the data-parallel path does not do, at once, with the reasons."""
        problems = self._problems(precision.accumulate_dtype, precision.scaler is not None, oom)
        if self.distributed and noise is not None and self.mode == "micro":
            problems.append(
                "noise=NoiseScale(...) with sync='micro': every prefix of the window is then "
                "reduced across ranks, and its global item count is not known without one more "
                "all-reduce per micro-batch; use sync='window'"
            )
        if problems:
            raise ValueError(
                f"the Accumulator on a {self.name.upper()} model cannot use:\n  - "
                + "\n  - ".join(problems)
            )

    def _problems(self, accumulate_dtype: Any, fp16: bool, oom: Any) -> list[str]:
        return []

    # -- per micro-batch ----------------------------------------------------------------------

    def communicates(self, last: bool) -> bool:
        """Whether the backward of a micro-batch reduces gradients across ranks."""
        return self.reduces(last) and not self.reduce_at_end

    def reduces(self, last: bool) -> bool:
        """Whether a micro-batch's gradient is reduced across ranks by the time the next
        one runs (in its backward, or at the window's end for the last): its prefix of the
        window is then not this rank's alone."""
        return self.distributed and (last or self.mode == "micro")

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Forward and backward of one micro-batch; they communicate only when ``last`` (or
        in ``"micro"`` mode)."""
        yield

    def check_forward(self, index: int) -> None:
        """Refuse a backward whose forward ran outside this micro-batch's context."""

    def check_after_last(self, ended_last: bool) -> None:
        """Under ``sync="window"`` nothing may follow the micro-batch marked last."""
        if ended_last and self.mode == "window":
            raise RuntimeError(
                "micro_batch() after the one marked last=True: its gradient would miss the "
                "reduction; end the window with end_window() first"
            )

    def check_window_end(self, ended_last: bool) -> None:
        """Under ``sync="window"`` a window must end with a micro-batch marked last."""

    def pad(self, given: list[Any]) -> tuple[list[Any], int]:
        """The micro-batches this rank runs in ``step()`` and how many of them are its own."""
        return given, len(given)

    # -- the window's end ---------------------------------------------------------------------

    def totals(self, count: int, loss_sum: float) -> tuple[int, float]:
        """Items and loss summed over ranks."""
        return count, loss_sum

    def sum(self, values: list[float]) -> list[float]:
        """Numbers summed over ranks, in float64 (one all-reduce; none in one process): a
        window's per-term counts before its first backward, its per-term sums at its end."""
        return [float(v) for v in values]

    def gather(self, local: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's ``local`` rows concatenated in rank order (ranks may hold different
        numbers of rows), and where this rank's rows start: an in-batch loss's negatives."""
        return local, 0

    def reduce(self, sums: list[torch.Tensor]) -> None:
        """Under ``reduce_at_end`` (DDP only): the window's sums averaged over ranks."""
        raise RuntimeError(f"a {self.name} model's gradient is not reduced at the window's end")

    def most(self, values: list[int]) -> list[int]:
        """Each value's largest over the ranks: e.g. the planner's measured peaks, so every
        rank decides on the fullest rank's numbers."""
        return [int(v) for v in values]

    def agree_oom(self, failed: bool, largest: int) -> tuple[bool, int]:
        """After a window's micro-batches: whether any rank ran out of memory, and the
        largest micro-batch any rank ran, so every rank replays together, at one size."""
        return bool(failed), int(largest)

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of each gradient."""
        return grads

    def norm(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradient. Non-finite anywhere is non-finite everywhere, so
        every rank takes the same skip and clipping decision."""
        return total_norm(local_grads)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """The model's and the optimizer's state for a checkpoint: the unwrapped module's
        (no DDP "module." prefix), so it loads with or without DDP."""
        return self.inner.state_dict(), optimizer.state_dict()

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, model: Any, state: Any) -> None:
        """Restore what ``state_dicts`` gave; what would not load is refused first, before
        anything changes (torch's module load copies what matches before it raises)."""
        _loadable(self.inner, optimizer, model, state)
        self.inner.load_state_dict(model)
        optimizer.load_state_dict(state)


def _loadable(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Any, state: Any):
    """Refuse, before anything is loaded, a model state dict or an optimizer state dict that
    their own ``load_state_dict`` would refuse part way (torch's module load copies every
    tensor that matches before it raises for the rest): every problem in one ValueError."""
    problems = []
    mine = model.state_dict()
    if not isinstance(saved, Mapping):
        raise ValueError(f"checkpoint's model state is a {type(saved).__name__}, not a state dict")
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    if missing:
        problems.append(f"the model's {', '.join(missing[:3])} not in it ({len(missing)} in all)")
    if unexpected:
        problems.append(f"{', '.join(unexpected[:3])} not in the model ({len(unexpected)} in all)")
    shapes = [
        f"{k} is {tuple(saved[k].shape)}, the model's {tuple(t.shape)}"
        for k, t in mine.items()
        if isinstance(saved.get(k), torch.Tensor) and saved[k].shape != t.shape
    ]
    if shapes:
        more = f" ({len(shapes)} tensors in all)" if len(shapes) > 3 else ""
        problems.append("; ".join(shapes[:3]) + more)
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if groups is not None:
        have = [len(g["params"]) for g in optimizer.param_groups]
        got = [len(g.get("params", ())) for g in groups]
        if have != got:
            problems.append(
                f"the optimizer's parameter groups hold {have} parameters, the checkpoint's "
                f"{got} (another optimizer setup)"
            )
    if not problems and isinstance(state, Mapping) and (trial := _trial(optimizer, state)):
        problems.append(trial)
    if problems:
        raise ValueError("checkpoint does not fit this model and optimizer: " + "; ".join(problems))


def _trial(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> str | None:
    """What goes wrong when ``state`` is loaded into a copy of ``optimizer`` over parameters
    on the meta device (no memory, nothing of the real one touched) and one step is taken
    with them: another optimizer's state (SGD's into AdamW: no ``step``), or another
    parameter order with the same group sizes (a state of one parameter's shape on
    another's). None where it loads and steps; also None where the copy cannot step with
    its own state either (an optimizer that cannot run on the meta device: nothing to
    learn from it)."""

    def attempt(loaded: Mapping[str, Any]) -> BaseException | None:
        shadow = _meta_copy(optimizer)
        try:
            shadow.load_state_dict(_scalars_copied(loaded))
            with torch.no_grad():
                type(optimizer).step(shadow)  # the class's: a scheduler wraps the instance's
        except Exception as err:  # noqa: BLE001 (whatever the optimizer raises is the answer)
            return err
        return None

    try:
        own = optimizer.state_dict()
    except Exception:  # noqa: BLE001 (an optimizer that cannot say its state: untried)
        return None
    if attempt(own) is not None:
        return None
    err = attempt(state)
    if err is None:
        return None
    reason = (str(err).strip().splitlines() or [""])[0][:160]
    return (
        f"its optimizer state does not load into or step this optimizer "
        f"({type(err).__name__}: {reason}; another optimizer, or its parameters in another order)"
    )


def _scalars_copied(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (an optimizer's state dict) with each scalar tensor copied: a load keeps a
    CPU ``step`` tensor as it is, and a step adds to it in place (the checkpoint's, or the
    real optimizer's own, would count the trial). The rest go to the meta device as the
    copy loads them."""
    per_param = state.get("state")
    if not isinstance(per_param, Mapping):
        return dict(state)
    copied = {
        key: {
            name: value.clone() if isinstance(value, torch.Tensor) and value.numel() <= 1 else value
            for name, value in entry.items()
        }
        if isinstance(entry, Mapping)
        else entry
        for key, entry in per_param.items()
    }
    return {**state, "state": copied}


def _meta_copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` whose groups hold meta-device stand-ins of its
    parameters (same shapes and dtypes, a gradient of zeros each) and whose state is empty."""
    import copy
    from collections import defaultdict

    shadow = copy.copy(optimizer)
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            stand_in = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
            stand_in.grad = torch.empty_like(stand_in)
            params.append(stand_in)
        groups.append({**group, "params": params})
    shadow.__dict__.update(param_groups=groups, state=defaultdict(dict))
    shadow.__dict__.pop("step", None)  # a scheduler's wrapper of the real one's step
    return shadow


class _Collective(Sync):
    """What every data-parallel and pipelined kind shares: the window's totals, padding and
    agreements over a process group, and the forward count that proves a micro-batch's
    forward ran inside its context."""

    distributed = True

    def __init__(self, model: torch.nn.Module | None, mode: str, group: Any) -> None:
        super().__init__(model, mode)
        self.group = group
        self.world = self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._device = collective_device(group)
        self._pad: Any = None  # one sample of a micro-batch this rank held, to pad with
        # forwards in the micro-batch in progress: of the distributed module, and of the
        # wrapper the user calls (``called_through``)
        self._forwards: list[int] | None = None
        if model is not None:
            self._count_forwards(model, 0)

    def _count_forwards(self, module: torch.nn.Module, slot: int) -> None:
        ref = weakref.ref(self)

        def count_forward(module: torch.nn.Module, args: Any) -> None:
            sync = ref()
            if sync is not None and sync._forwards is not None:
                sync._forwards[slot] += 1

        handle = module.register_forward_pre_hook(count_forward)
        weakref.finalize(self, handle.remove)

    def called_through(self, outer: torch.nn.Module, via: tuple[str, ...]) -> None:
        """The user calls ``outer``, a wrapper (``via``: its chain of classes) around this
        Sync's module: its forwards are counted too, so that a wrapper whose forward does
        not run the distributed module is told apart from a loss computed outside."""
        self.via = via
        self._count_forwards(outer, 1)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """DDP decides in forward whether the backward communicates, FSDP2 in backward: the
        context wraps both."""
        self._forwards = [0, 0]
        restore = self._communicate(self.communicates(last))
        try:
            yield
        finally:
            self._forwards = None
            restore()

    def _communicate(self, communicate: bool) -> Callable[[], None]:
        """Set whether the next backward communicates; returns how to set it back."""
        raise NotImplementedError

    def check_forward(self, index: int) -> None:
        forwards, outer = self._forwards or (0, 0)
        if not forwards and outer:
            kind = type(self.model).__name__
            raise RuntimeError(
                f"micro-batch {index}: the forward of {self.via[0]} ran but did not run the "
                f"{kind} inside it ({' > '.join(self.via)} > {kind}); {kind} decides in its "
                "forward whether the backward communicates, so gradaccum cannot control it "
                f"through this wrapper: hand the Accumulator a model whose forward runs the "
                f"{kind} module"
            )
        if not forwards:
            raise RuntimeError(
                f"micro-batch {index}: no forward of the {self.name.upper()} model ran inside "
                "`with acc.micro_batch(...)`; the loss was computed outside it. The forward "
                "decides whether the backward communicates gradients, so a forward outside the "
                "context would reduce on the wrong micro-batch and leave the ranks' gradients "
                "different: compute the loss inside the context"
            )

    def check_window_end(self, ended_last: bool) -> None:
        if not ended_last and self.mode == "window":
            raise RuntimeError(
                f"the window ended without a micro-batch marked last=True; under "
                f"{self.name.upper()} the last micro-batch's backward is the one that "
                "reduces gradients: use `with acc.micro_batch(last=True)` for it"
            )

    def pad(self, given: list[Any]) -> tuple[list[Any], int]:
        """Every rank runs as many micro-batches as the rank that holds the most: collective
        calls (DDP's reduction, FSDP2's all-gathers) must match, or ranks hang. A rank with
        fewer (or none) replays one sample it has held, with loss and count times zero,
        which adds exact zeros. That sample is copied from the window's last micro-batch, so
        the micro-batch itself is not kept past its window. One small all-reduce (MAX)."""
        if given:
            self._pad = map_tensors(given[-1], lambda t: t[:1].clone())
        most, stuck = self._all_reduce(
            [len(given), int(self._pad is None)], torch.int64, dist.ReduceOp.MAX
        )
        if stuck:
            raise ValueError(
                "a rank got an empty window before it ever held a micro-batch, so it has "
                "nothing to run in step with the other ranks; give every rank at least one "
                "micro-batch in its first window (later empty windows are padded)"
            )
        if most == 0:
            raise ValueError(
                "step() got an empty window on every rank: a window needs at least one micro-batch"
            )
        return given + [self._pad] * (int(most) - len(given)), len(given)

    def totals(self, count: int, loss_sum: float) -> tuple[int, float]:
        """One all-reduce of two float64 scalars per window (exact for counts below 2**53)."""
        total, loss = self._all_reduce([float(count), loss_sum], torch.float64, dist.ReduceOp.SUM)
        return int(total), loss

    def sum(self, values: list[float]) -> list[float]:
        if not values:
            return []
        return self._all_reduce([float(v) for v in values], torch.float64, dist.ReduceOp.SUM)

    def gather(self, local: torch.Tensor) -> tuple[torch.Tensor, int]:
        # all_gather needs one shape: the rows are padded to the most any rank holds
        world = dist.get_world_size(self.group)
        rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=self._device)
        counts = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(counts, rows, group=self.group)
        sizes = [int(c) for c in counts]
        padded = local.new_zeros((max(sizes), *local.shape[1:])).to(self._device)
        padded[: local.shape[0]] = local.to(self._device)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=self.group)
        whole = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        me = dist.get_rank(self.group)
        return whole.to(local.device), sum(sizes[:me])

    def most(self, values: list[int]) -> list[int]:
        return [int(v) for v in self._all_reduce(values, torch.int64, dist.ReduceOp.MAX)]

    def agree_oom(self, failed: bool, largest: int) -> tuple[bool, int]:
        failed_anywhere, most = self._all_reduce(
            [int(failed), largest], torch.int64, dist.ReduceOp.MAX
        )
        return bool(failed_anywhere), int(most)

    def _summed_norm(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of a gradient whose parts live on different ranks (FSDP2's shards, a
        pipeline's stages): their squares summed over the group."""
        squared = total_norm(local_grads).double().square().to(self._device)
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()

    def _all_reduce(self, values: list[float], dtype: torch.dtype, op: Any) -> list[float]:
        t = torch.tensor(values, dtype=dtype, device=self._device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()


class DDPSync(_Collective):
    """DistributedDataParallel: the last micro-batch's backward all-reduces, unless the
    window's sums live outside ``.grad`` (fp32 buffers) or OOM replay must be agreed, when
    the Accumulator reduces them at the window's end (``reduce``). Gradients are replicated
    after the reduction, so the local norm is the global one."""

    name = "ddp"

    def __init__(self, model: DistributedDataParallel, mode: str = "window") -> None:
        super().__init__(model, mode, model.process_group)
        self.inner = model.module

    def _problems(self, accumulate_dtype: Any, fp16: bool, oom: Any) -> list[str]:
        self.reduce_at_end = accumulate_dtype is not None or oom is not None
        if self.reduce_at_end and self.mode == "micro":
            why = "fp32 accumulation buffers" if accumulate_dtype is not None else "OOM replay"
            return [
                f"sync='micro' with {why} under DDP: the window's sum is then reduced once, at "
                "its end; use sync='window'"
            ]
        return []

    def _communicate(self, communicate: bool) -> Callable[[], None]:
        before = self.model.require_backward_grad_sync
        self.model.require_backward_grad_sync = communicate

        def restore() -> None:
            self.model.require_backward_grad_sync = before

        return restore

    def reduce(self, sums: list[torch.Tensor]) -> None:
        """The window's summed gradients averaged over ranks in place, as DDP's reduction
        would (sum / world), one all-reduce per dtype; and the module's buffers broadcast
        from rank 0, as DDP's next forward would (it broadcasts only after a backward that
        communicated, which no longer happens)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in sums:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.model.broadcast_buffers:
            with torch.no_grad():
                for b in self.inner.buffers():
                    dist.broadcast(b, src=dist.get_global_rank(self.group, 0), group=self.group)


class FSDPSync(_Collective):
    """FSDP2's fully_shard: the last micro-batch's backward reduce-scatters, each rank holds
    shards (DTensors) of every gradient, and the norm sums their squares over ranks."""

    name = "fsdp"
    sharded = True

    def __init__(self, model: torch.nn.Module, mode: str = "window") -> None:
        super().__init__(model, mode, None)

    def _problems(self, accumulate_dtype: Any, fp16: bool, oom: Any) -> list[str]:
        problems = []
        if accumulate_dtype is not None:
            problems.append(
                f"accumulate_dtype={accumulate_dtype}: FSDP2 reduces inside backward and "
                "accumulates in its own reduce dtype; give fully_shard "
                "mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32) instead"
            )
        if fp16:
            problems.append(
                "precision='fp16' under FSDP2: each rank would see only its shards' overflow; "
                "use precision='bf16'"
            )
        if oom is not None:
            problems.append(
                "oom=OOMReplay(...) under FSDP2: every forward gathers parameters across "
                "ranks, so a rank that runs out of memory midway leaves the others waiting; "
                "pass oom=None"
            )
        return problems

    def _communicate(self, communicate: bool) -> Callable[[], None]:
        self.model.set_requires_gradient_sync(communicate)
        return lambda: self.model.set_requires_gradient_sync(True)

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """An FSDP2 shard is a DTensor; its local tensor shares storage, so scaling it in
        place scales the gradient."""
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    def norm(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        return self._summed_norm(local_grads)

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """This rank's shards of the model and of the optimizer's state, keyed by parameter
        name (DTensors). An optimizer that has not stepped yet has no state, and gives None:
        torch's helper would make one by stepping with zero gradients, which starts AdamW's
        step count at 1 and so changes the first real step's bias correction."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model = get_model_state_dict(self.model)
        if not optimizer.state:
            return model, None
        return model, get_optimizer_state_dict(self.model, optimizer)

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, model: Any, state: Any) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self.model, dict(model))
        if state is None:  # saved before the first step: a fresh optimizer's empty state
            optimizer.state.clear()
        else:
            set_optimizer_state_dict(self.model, optimizer, dict(state))


class PipelineSync(_Collective):
    """The stages of one pipeline (``torch.distributed.pipelining``): each holds its own
    parameters, so the norm sums squares over the stages as over FSDP2's shards; nothing
    averages a gradient over them (``world`` 1 for the divisor); the last stage alone knows
    the counts, which ``totals`` sums over the group. The schedule runs the micro-batches,
    so there is no micro-batch context here."""

    name = "pipeline"

    def __init__(self, group: Any = None) -> None:
        super().__init__(None, "window", group)
        self.world = 1

    def reduces(self, last: bool) -> bool:
        return False  # each stage holds its own parameters: none is reduced across stages

    def norm(self, local_grads: list[torch.Tensor]) -> torch.Tensor:
        return self._summed_norm(local_grads)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is wrapped by FSDP2's fully_shard, seen through the wrappers that
    ``Sync.of`` sees through (and refused where it refuses)."""
    found, _ = _unwrap(model)
    return found is not None and _is_fsdp(found)


def collective_device(group: Any = None) -> torch.device:
    """Where a group's collectives take their tensors: the current GPU for nccl, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
