"""``estimate()``: one window of training traced with fake tensors, its peak as CUDA's caching
allocator would report it (docs/planning.md, "Estimating for a GPU that is not here")."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradaccum.planning.estimate import allocator as alloc
from gradaccum.planning.estimate import cuda, fsdp, zero
from gradaccum.planning.estimate.devices import gpu as find_gpu
from gradaccum.planning.estimate.optimizers import bitsandbytes_refusal
from gradaccum.planning.estimate.result import PARTS, Estimate
from gradaccum.planning.estimate.stream import Stream
from gradaccum.planning.estimate.trace import (
    HostReads,
    Tally,
    TraceError,
    apply_order,
    fake_mode,
    module_names,
    moves_in_place,
)

__all__ = ["at_length", "at_size", "estimate"]

_DEVICES = ("cuda", "cpu")
_SHARDS = ("ddp", "fsdp", "zero")
TRUE_BF16 = "bf16-true"  # a precision of the estimate alone: the model cast, no autocast


def estimate(
    model: Callable[[], torch.nn.Module],
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    sample: Any,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    *,
    micro_size: int | None = None,
    micro_batches: int = 1,
    device: str = "cuda",
    gpu: Any = None,
    precision: str = "fp32",
    checkpointing: bool = False,
    evaluate: bool = False,
    max_grad_norm: float | None = None,
    allocator: str | alloc.AllocatorConfig | None = None,
    prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    world_size: int = 1,
    shard: str = "ddp",
    sync: str = "window",
    repeat: bool = False,
    keep: bool = False,
    deepspeed: zero.ZeroConfig | None = None,
) -> Estimate:
    """The peak memory of a window of ``micro_batches`` micro-batches on ``device``, without
    that device, without the model's weights, without compute.

    ``model()`` builds the model (from a config: it runs on fake tensors, so its weights never
    exist); ``optimizer(params)`` builds the optimizer over the trainable parameters;
    ``sample(micro_size)`` makes one micro-batch (or ``sample`` is a micro-batch);
    ``loss_fn(model, micro_batch) -> (loss_sum, count)`` as for ``Accumulator.step``.
    ``prepare(model)`` returns the model to train (LoRA adapters, for one) after it is built.
    ``world_size`` > 1: one of that many data-parallel processes. ``shard="ddp"``: each with
    the whole model in ``DistributedDataParallel``, whose gradient buckets are a second copy
    of the gradients. ``shard="fsdp"``: FSDP2's ``fully_shard`` on each repeated block and
    the root, modelled from the unsharded trace (``gradaccum.planning.estimate.fsdp``), with
    gradaccum's gradient ``sync`` ("window": the unsharded gradient kept between
    micro-batches, one reduce-scatter per window; "micro": one per micro-batch, the sharded
    gradient accumulated); the peak is rank 0's (the largest shards). ``shard="zero"``:
    DeepSpeed's engine with ZeRO stage 1 or 2 as ``deepspeed`` (a
    ``gradaccum.planning.estimate.zero.ZeroConfig``) sets it, on rank 0 of ``world_size``,
    modelled by ``gradaccum.planning.estimate.zero`` (``precision`` is then the
    configuration's: the module cast, no autocast). bitsandbytes' quantized
    layers are refused for ``gradaccum.planning.estimate.quantized.quantize``'s model of them.
    ``repeat=True`` traces the first window and repeats its events for the second (half
    the time): right where a trace of both showed the second to be the first repeated
    (``Estimate.steady``, which every trace of two windows reports); not under FSDP2.
    ``keep=True`` keeps the traced allocation sequence in ``Estimate.stream`` (not under
    FSDP2; ``sample`` a function of the size): two such estimates at different sizes give
    any other size with ``at_size``, without a trace.

    Two windows run through a real ``Accumulator``: the first creates the optimizer's state,
    the second is the steady one; the peak is over both. ``evaluate=True`` adds a forward
    under ``torch.no_grad()`` after them. ``device="cuda"`` models what CUDA does differently
    (``gradaccum.planning.estimate.cuda``) and the caching allocator (``allocator``: a
    ``PYTORCH_CUDA_ALLOC_CONF`` string or an ``AllocatorConfig``); ``gpu`` names the family
    whose constants are added (``gradaccum.planning.estimate.devices.GPUS``).
    ``device="cpu"`` traces as the CPU runs, so the trace can be checked against a real run
    here. ``precision``: as ``Accumulator`` takes it ("fp32", "bf16", "fp16"), or
    "bf16-true": every floating parameter cast to bf16 after ``prepare`` (so its gradient
    and the optimizer's state are bf16 too) and no autocast, as Lightning's and litgpt's
    ``precision="bf16-true"`` trains.
    """
    if device not in _DEVICES:
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if not callable(model) or isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a function that builds the model (its weights are never made), "
            f"got {type(model).__name__}"
        )
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if callable(sample) and micro_size is None:
        raise ValueError("micro_size is needed when sample is a function of it")
    if shard not in _SHARDS:
        raise ValueError(f"shard must be 'ddp', 'fsdp' or 'zero', got {shard!r}")
    if (shard == "zero") != (deepspeed is not None):
        raise ValueError("shard='zero' and deepspeed=ZeroConfig(...) go together")
    if sync not in fsdp.SYNCS:
        raise ValueError(f"sync must be 'window' or 'micro', got {sync!r}")
    if shard == "fsdp" and (refusal := _fsdp_refusal(world_size, precision, evaluate)):
        raise ValueError(refusal)
    target = find_gpu(gpu) if device == "cuda" else None
    config = allocator if isinstance(allocator, alloc.AllocatorConfig) else None
    config = config or alloc.AllocatorConfig.parse(allocator if isinstance(allocator, str) else "")
    started = time.perf_counter()
    with _collector_paused():
        tally, host, unified, assumptions = _trace(
            model,
            optimizer,
            sample,
            loss_fn,
            micro_size=micro_size,
            micro_batches=micro_batches,
            on_cuda=device == "cuda",
            precision=precision,
            checkpointing=checkpointing,
            evaluate=evaluate,
            max_grad_norm=max_grad_norm,
            prepare=prepare,
            world_size=world_size,
            shard=shard,
            sync=sync,
            repeat=repeat,
            deepspeed=deepspeed,
        )
    kept = None
    if keep and shard != "fsdp" and callable(sample) and micro_size is not None:
        kept = Stream.of(tally, micro_size, host, unified, assumptions, config)
    return _conclude(
        tally,
        host,
        unified,
        list(assumptions),
        target,
        config,
        device=device,
        micro_size=micro_size,
        micro_batches=micro_batches,
        seconds=time.perf_counter() - started,
        sync=sync if shard == "fsdp" else None,
        steady=getattr(tally, "steady", False),  # a sharded trace (fsdp.Events) is not repeated
        stream=kept,
    )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while a window is traced, and run once after it: an
    automatic collection starts wherever an allocation tips it, inside an op's dispatch too,
    and freed fake tensors under the dispatcher there. The trace process then ended in heap
    corruption ("corrupted double-linked list", a segmentation fault), by chance and more
    often under load: 5 of 6 Qwen-14B LoRA estimates with trained embeddings."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if enabled:
            gc.enable()


def at_size(a: Estimate, b: Estimate, micro_size: int) -> Estimate | None:
    """The estimate at ``micro_size`` (2 or more) from two of the same window at other sizes
    of 2 or more (each made with ``keep=True``), with no trace: their allocation sequences
    scaled (``gradaccum.planning.estimate.stream``) and replayed. None where the two do not show
    the sequence at another size (trace that size instead)."""
    if a.stream is None or b.stream is None or not _alike(a, b):
        return None
    grows = a.stream.grows(b.stream)
    stream = None if grows is None else a.stream.at(micro_size, grows)
    return _replayed(a, stream, steady=a.steady and b.steady)


def at_length(
    whole: Estimate,
    before: Estimate,
    after: Estimate,
    others: tuple[Estimate, Estimate] | None = None,
) -> Estimate | None:
    """The estimate of ``whole`` (a model of repeated blocks) at another sequence length,
    with no trace of it: ``before`` and ``after`` are a smaller model of the same blocks
    (two of them) at ``whole``'s length and at the other, at its micro-batch size, each
    made with ``keep=True``; ``whole``'s allocation sequence is changed as theirs changed
    (``Stream.resized``) and replayed. ``others``: ``whole`` and ``before`` at another
    micro-batch size (both sizes at least 2), which tell apart allocations that grow with
    the micro-batch from those of the same shape that do not. None where the traces do not
    show it (trace instead)."""
    estimates = (whole, before, after, *(others or ()))
    if any(e.stream is None for e in estimates) or not _alike(whole, before, after):
        return None
    grows = None
    if others is not None:
        grows = (whole.stream.grows(others[0].stream), before.stream.grows(others[1].stream))
        if None in grows:
            return None
    stream = whole.stream.resized(before.stream, after.stream, grows)
    return _replayed(whole, stream, steady=whole.steady and after.steady)


_ALIKE = ("device", "gpu", "micro_batches", "context", "sync")


def _alike(*estimates: Estimate) -> bool:
    """Whether the estimates are of one window's setting (device, card, micro-batches)."""
    return all(len({getattr(e, f) for e in estimates}) == 1 for f in _ALIKE)


def _replayed(like: Estimate, stream: Stream | None, steady: bool) -> Estimate | None:
    """``stream`` (read off traces, not traced) replayed as ``like``'s was: its estimate."""
    if stream is None:
        return None
    try:
        target = find_gpu(like.gpu) if like.device == "cuda" else None
        config = alloc.AllocatorConfig(**stream.allocator)
    except (TypeError, ValueError):  # a GPU given as an object, not a name; a damaged record
        return None
    return _conclude(
        Tally.of(stream.events(), stream.tags()),
        set(stream.host),
        stream.unified,
        list(stream.assumptions),
        target,
        config,
        device=like.device,
        micro_size=stream.micro_size,
        micro_batches=like.micro_batches,
        seconds=0.0,
        sync=like.sync,
        steady=steady,
        stream=stream,
    )


def _conclude(tally, host, unified, assumptions, target, config, **fields) -> Estimate:
    """The estimate of a traced (or scaled) sequence: on CUDA, replayed through the
    allocator model with the GPU's constants added."""
    if target is None:
        parts = _parts(tally, tally.peak_index, set(), rounded=False)
        allocated = reserved = total = tally.peak
    else:
        events, upto = _device_events(tally, host, target)
        replayed = alloc.replay(events, config)
        allocated, reserved = replayed.peak_allocated, replayed.peak_reserved
        index = upto[replayed.peak_index - 1] if replayed.peak_index else 0
        parts = _parts(tally, index, host, rounded=True)
        parts["temporaries"] += target.workspace * target.handles
        parts["allocator rounding"] = allocated - sum(parts.values())
        total = reserved + target.context + unified
        assumptions += [
            f"{target.name}: CUDA context and libraries {target.context / 2**20:.0f} MiB (not "
            f"measured); cuBLAS workspace {target.workspace / 2**20:.3g} MiB x {target.handles}",
            f"caching allocator: {_describe(config)}",
        ]
    return Estimate(
        gpu=None if target is None else target.name,
        allocated=allocated,
        reserved=reserved,
        total=total,
        tensor_peak=tally.peak,
        parts=parts,
        assumptions=tuple(assumptions),
        context=0 if target is None else target.context,
        unified=unified,
        **fields,
    )


def _trace(model, optimizer, sample, loss_fn, *, micro_size, micro_batches, on_cuda, **how):
    from gradaccum.batching import map_tensors
    from gradaccum.engine import Accumulator
    from gradaccum.precision import PRECISIONS, Precision
    from gradaccum.recompute import enable_checkpointing

    precision = how["precision"]
    if precision not in (*PRECISIONS, TRUE_BF16):
        raise ValueError(
            f"precision must be one of {', '.join((*PRECISIONS, TRUE_BF16))}, got {precision!r}"
        )
    assumptions: list[str] = []
    fake, tally = fake_mode(), Tally()
    with fake:
        try:
            with moves_in_place(), HostReads():
                module = model()
                if how["prepare"] is not None:
                    module = how["prepare"](module)
        except TraceError:
            raise
        except Exception as err:
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
            raise TraceError("the model's construction", "model()", reason) from err
        if refusal := _unmodelled(module):
            raise ValueError(refusal)
        if precision == TRUE_BF16:  # every weight in bf16 and no autocast
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
            assumptions.append(
                "bf16-true: every parameter, its gradient and the optimizer's state in bf16, "
                "no autocast (Lightning's and litgpt's precision='bf16-true')"
            )
            precision = "fp32"  # the Accumulator's: no autocast, no scaler
        if how["checkpointing"]:
            enable_checkpointing(module)
        params: dict[int, tuple[int, ...]] = {}  # the parameters' storages, for FSDP2's shards
        for tensor in apply_order(module):
            tally.tag(tensor, "parameters")
            if isinstance(tensor, torch.nn.Parameter):
                params[tally.record(tensor)] = tuple(tensor.shape)
        trainable = [p for p in module.parameters() if p.requires_grad]
        sharded = how["shard"] == "fsdp"
        if sharded and (odd := [p.dtype for p in trainable if p.dtype != torch.float32]):
            raise ValueError(
                f"shard='fsdp' with {odd[0]} trainable parameters is not modelled (FSDP2's "
                "MixedPrecisionPolicy and low-precision gradients are not); train them in float32"
            )
        units = fsdp.layout(module, how["world_size"]) if sharded else None
        marks = fsdp.Marks(units, tally) if sharded else contextlib.nullcontext()
        ddp = how["world_size"] > 1 and how["shard"] == "ddp"
        buckets = ddp_buckets(trainable) if ddp else []
        for bucket in buckets:  # DistributedDataParallel(model) allocates them when built
            tally.tag(bucket, "gradients")
        if buckets:
            assumptions.append(
                f"world size {how['world_size']}: each process holds the whole model in "
                "DistributedDataParallel, its gradient buckets a second copy of the "
                "gradients (gradient_as_bucket_view=False, its default), one per dtype as its "
                "constructor makes them (their rebuild into 25 MiB buckets after the first "
                "step, the same bytes, not modelled)"
            )
        engine = None
        if how["shard"] == "zero":
            engine = zero.Engine(module, optimizer, how["deepspeed"], how["world_size"], tally.tag)
            assumptions.append(how["deepspeed"].describe(how["world_size"]))
            opt, precision = engine.optimizer, "fp32"  # the module cast: no autocast
        else:
            opt = optimizer(trainable)
        if refusal := bitsandbytes_refusal(opt):
            raise ValueError(refusal)
        if on_cuda and cuda.prefer_foreach(opt):
            assumptions.append("optimizer: torch's foreach implementation, its CUDA default")
        chosen: Any = precision
        if precision == "fp16":  # the windows step, as a run's steady ones do (_SteppingScaler)
            chosen = Precision("fp16", scaler=_SteppingScaler(trainable[0].device.type))
            assumptions.append(
                "fp16: every window steps (a window whose gradient overflowed skips its "
                "optimizer step and holds no more than one that steps)"
            )
        acc = engine or Accumulator(
            module, opt, precision=chosen, max_grad_norm=how["max_grad_norm"]
        )
        low = PRECISIONS[precision]
        cuda_model = cuda.CudaModel(low) if on_cuda else None
        if cuda_model is not None and low is not None:
            # CUDA's autocast lists, not the CPU's (an attribute of this one Precision object)
            acc.precision.autocast = cuda_model.region
            assumptions.append(f"autocast: CUDA's {precision} op lists")
        for p in trainable if engine is None else ():
            p.register_post_accumulate_grad_hook(lambda p: tally.tag(p.grad, "gradients"))

        def make() -> Any:
            if callable(sample):
                return sample(micro_size)
            return torch.utils._pytree.tree_map(
                lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, sample
            )

        def traced_loss(m: torch.nn.Module, batch: Any) -> Any:
            # the accumulation buffers of the micro-batches before (the engine tags its own)
            for p in trainable if engine is None else ():
                tally.tag(acc.precision.accumulated(p), "gradients")
            return loss_fn(m, batch)

        def pack(t: torch.Tensor) -> torch.Tensor:
            tally.tag(t, "activations")
            return t

        with (
            tally,
            cuda_model or contextlib.nullcontext(),
            marks,
            module_names(module, tally),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            pad = None
            bounds: list[tuple[int, int]] = []
            for window in range(2):
                begun = len(tally.events)
                if window == 1 and how["repeat"] and not sharded and tally.repeat(*bounds[0]):
                    tally.steady = True  # repeated: the same window by construction
                    break
                batches = [make() for _ in range(micro_batches)]
                if how["world_size"] > 1:  # the one sample a distributed window keeps to pad
                    pad = map_tensors(batches[-1], lambda t: t[:1].clone())  # noqa: F841
                acc.step(batches, traced_loss)
                for state in opt.state.values():
                    for value in state.values():
                        tally.tag(value, "optimizer state")
                del batches  # a window's data is freed with it, before the next is made
                bounds.append((begun, len(tally.events)))
            else:  # both windows traced: whether the second was the first repeated
                tally.steady = tally.same_window(*bounds)
            if how["evaluate"]:
                module.eval()
                with torch.no_grad():
                    loss_fn(module, make())
                module.train()
        host = cuda.host_serials(opt, tally.record) if on_cuda else set()
        # paged optimizer state: CUDA unified memory, outside the caching allocator
        paged = getattr(opt, "outside_allocator", []) if on_cuda else []
        host |= {tally.record(t) for t in paged}
        unified = sum(t.untyped_storage().nbytes() for t in paged)
        if unified:
            assumptions.append(
                f"paged optimizer state {unified / 2**20:.1f} MiB in CUDA unified memory: "
                "outside the caching allocator (not in allocated or reserved), counted in the "
                "device total as resident"
            )
    if sharded:
        shapes = {tuple(p.shape) for p in trainable}
        tally = fsdp.shard(
            tally, marks, units, params, shapes, sync=how["sync"], micro_batches=micro_batches
        )
        blocks = len(units.modules) - 1
        assumptions.append(
            f"world size {how['world_size']}, FSDP2 (fully_shard) on {blocks} repeated blocks "
            "and the root, rank 0's share (dim-0 shards padded to a multiple of the world "
            "size); default settings: reshard_after_forward (the root's not), one unit's "
            "all-gather prefetched in backward, one reduce-scatter input held; gradient sync "
            + (
                "'window': each unit's unsharded gradient kept between micro-batches, one "
                "reduce-scatter per window"
                if how["sync"] == "window"
                else "'micro': a reduce-scatter per micro-batch, the sharded gradient accumulated"
            )
        )
    return tally, host, unified, assumptions


class _SteppingScaler(torch.amp.GradScaler):
    """fp16's GradScaler as the estimate runs it. Whether a window's gradient overflowed is a
    host read of a value fake tensors do not have (the trace answers 1.0: "found inf"), so the
    scaler skipped every traced optimizer step, and every fp16 estimate left the optimizer's
    state out. A run's steady windows step: here every window does."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


def _fsdp_refusal(world_size: int, precision: str, evaluate: bool) -> str | None:
    """One line for what FSDP2's model does not cover (HSDP, CPU offload and mixed precision
    policies are not arguments: a ``fully_shard``-wrapped model is refused by ``_unmodelled``)."""
    if world_size < 2:
        return f"shard='fsdp' needs world_size of 2 or more, got {world_size}"
    if precision == "fp16":
        return (
            "shard='fsdp' with precision='fp16' is not modelled (gradaccum refuses fp16 under "
            "FSDP2: each rank would see only its own shards' overflow)"
        )
    if evaluate:
        return "shard='fsdp' with evaluate=True is not modelled (FSDP2's evaluation forward)"
    return None


def ddp_buckets(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """``DistributedDataParallel``'s gradient buckets for ``params`` as its constructor
    allocates them by default (``find_unused_parameters=False``): one flat bucket per dtype
    holding every gradient (torch/nn/parallel/distributed.py, ``compute_bucket_size_limits``:
    ``[sys.maxsize]`` until the first step's backward gives the order to rebuild them in)."""
    counts: dict[torch.dtype, int] = {}
    for p in params:
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=d, device=params[0].device) for d, n in counts.items()]


def _unmodelled(module: torch.nn.Module) -> str | None:
    """One line for a model the estimate does not model: bitsandbytes' quantized layers (a
    frozen 8-bit or 4-bit base) or FSDP2's sharded modules."""
    fsdp = getattr(torch.distributed, "fsdp", None) if torch.distributed.is_available() else None
    sharded = getattr(fsdp, "FSDPModule", None)
    for name, sub in module.named_modules():
        cls = type(sub)
        where = name or type(module).__name__
        if cls.__module__.startswith("bitsandbytes"):
            return (
                f"model: {where} is bitsandbytes' {cls.__name__}, whose kernels do not run on "
                "fake tensors; build the base unquantized and pass prepare=lambda m: "
                "gradaccum.planning.estimate.quantized.quantize(apply_lora(m), 'nf4'), its "
                "documented layout"
            )
        if sharded is not None and isinstance(sub, sharded):
            return (
                f"model: {where} is already sharded by FSDP2 (fully_shard); build it unwrapped "
                "and pass shard='fsdp' with the world size"
            )
    return None


def _device_events(tally: Tally, host: set[int], target) -> tuple[list, list[int]]:
    """The device's allocation sequence: the traced one less what stays on the host, with
    the cuBLAS workspaces allocated once the parameters are (at the first matmul); and for
    each event, how many of the traced events had run by then."""
    events, upto, workspaces = [], [], False
    for i, event in enumerate(tally.events):
        if event[1] in host:
            continue
        if not workspaces and event[0] == "alloc" and tally.tags.get(event[1]) != "parameters":
            workspaces = True
            for h in range(target.handles):
                events.append(("alloc", ("workspace", h), target.workspace))
                upto.append(i)
        events.append(event)
        upto.append(i + 1)
    return events, upto


def _parts(tally: Tally, index: int, host: set[int], rounded: bool) -> dict[str, int]:
    parts = dict.fromkeys(PARTS[:-1], 0)
    for serial, size in tally.live_at(index).items():
        if serial in host:
            continue
        size = alloc.round_size(size) if rounded and size else size
        parts[tally.tags.get(serial, "temporaries")] += size
    return parts


def _describe(config: alloc.AllocatorConfig) -> str:
    given = [
        f"{f.name}={getattr(config, f.name)}"
        for f in config.__dataclass_fields__.values()
        if getattr(config, f.name) != f.default
    ]
    return ", ".join(given) if given else "PyTorch's defaults (PYTORCH_CUDA_ALLOC_CONF unset)"
