"""What each of the 2 processes runs. Results go to files the test reads and checks against
a single-process full-batch reference (tests/helpers.py), never against gradaccum itself."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import TinyLM, lm_loss, make_model, padded_lm_batch, split_sizes
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import gradaccum as ga
from gradaccum.noise import NoiseScale

GLOBAL_BATCH = 13


def optimizer(params) -> torch.optim.Optimizer:
    # SGD with momentum, not Adam: Adam divides out a gradient's scale, so a gradient off by
    # the world size (DDP's averaging not undone) would barely move Adam's parameters.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


# Per optimizer step, the micro-batch sizes of rank 0 and of rank 1. Rank 0 holds the first
# sum(rank 0 sizes) sequences of the step's global batch of 13, rank 1 the rest, so the
# ranks hold different numbers of tokens in every step.
SCENARIOS = {
    "uneven tokens": [([3, 5], [2, 3])] * 3,
    "fewer micro-batches": [([3, 5], [2, 3]), ([2, 2, 2, 2], [5]), ([4, 4], [1, 1, 1, 1, 1])],
    "empty rank": [([3, 5], [2, 3]), ([6, 7], []), ([5, 3], [5])],
    # the same as "fewer micro-batches", reducing every micro-batch (sync="micro")
    "sync per micro-batch": [([3, 5], [2, 3]), ([2, 2, 2, 2], [5]), ([4, 4], [1, 1, 1, 1, 1])],
}


def wrap(model: torch.nn.Module, kind: str, root_only: bool = False) -> torch.nn.Module:
    if kind == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    if not root_only:
        for block in model.blocks:
            fully_shard(block)
    fully_shard(model)
    return model


def my_micro_batches(step: int, sizes: tuple[list[int], list[int]], rank: int) -> list:
    batch = padded_lm_batch(seed=11 + step, n=GLOBAL_BATCH)
    assert sum(sizes[0]) + sum(sizes[1]) == GLOBAL_BATCH
    start = 0 if rank == 0 else sum(sizes[0])
    mine = {k: v[start : start + sum(sizes[rank])] for k, v in batch.items()}
    return split_sizes(mine, sizes[rank])


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = p.detach().clone()
    return out


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.removeprefix("module.")] = g.detach().clone()
    return out


def train(rank: int, world: int, kind: str, out: str) -> None:
    """Every scenario, 3 optimizer steps each; rank 0 saves parameters and step losses."""
    results = {}
    for name, steps in SCENARIOS.items():
        model = wrap(make_model(TinyLM), kind)
        opt = optimizer(model.parameters())
        handed = []  # the gradient the optimizer is given at each step, in full
        opt.register_step_pre_hook(lambda *_, h=handed, m=model: h.append(full_grads(m)))
        acc = ga.Accumulator(
            model, opt, sync="micro" if name == "sync per micro-batch" else "window"
        )
        losses = []
        for step, sizes in enumerate(steps):
            result = acc.step(my_micro_batches(step, sizes, rank), lm_loss)
            assert result.stepped, result
            losses.append(result.loss)
        results[name] = {
            "params": full_params(model),
            "grads": handed,
            "losses": losses,
            "state": acc.state,
        }
    if rank == 0:
        torch.save(results, Path(out) / f"{kind}.pt")


class CountingReduceScatter:
    """FSDP2's reduce-scatter, counted (set_custom_reduce_scatter takes any object with
    ``allocate`` and ``__call__``)."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def count(rank: int, world: int, kind: str, mode: str, n: int, out: str) -> None:
    """Gradient reductions over 3 optimizer steps of n micro-batches each."""
    model = wrap(make_model(TinyLM), kind, root_only=True)
    if kind == "ddp":
        calls = [0]

        def hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    else:
        counter = CountingReduceScatter()
        model.set_custom_reduce_scatter(counter)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), sync=mode)
    for step in range(3):
        batch = padded_lm_batch(seed=20 + 2 * step + rank, n=2 * n)
        acc.step(split_sizes(batch, [2] * n), lm_loss)
    if rank == 0:
        reductions = calls[0] if kind == "ddp" else counter.calls
        torch.save(
            {"reductions": reductions, "steps": acc.state.optimizer_steps},
            Path(out) / f"count-{kind}-{mode}-{n}.pt",
        )


def ddp_grads_across_ranks(rank: int, world: int, out: str) -> None:
    """Manual API: the largest difference between the two ranks' accumulated gradients after
    the first micro-batch (no sync) and after the last one (sync)."""
    model = wrap(make_model(TinyLM), "ddp")
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    micro = split_sizes(padded_lm_batch(seed=30 + rank, n=6), [3, 3])

    def spread() -> float:
        grads = acc.accumulated_gradient()
        flat = torch.cat([grads[k].flatten() for k in sorted(grads)])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        return float((gathered[0] - gathered[1]).abs().max())

    with acc.micro_batch():
        acc.backward(*lm_loss(model, micro[0]))
    before = spread()
    with acc.micro_batch(last=True):
        acc.backward(*lm_loss(model, micro[1]))
    after = spread()
    result = acc.end_window()

    # Misuse is refused the same way on every rank, before any collective could hang.
    errors = []
    with acc.micro_batch():
        acc.backward(*lm_loss(model, micro[0]))
    try:
        acc.end_window()  # no micro-batch marked last: nothing was reduced
    except RuntimeError as err:
        errors.append(str(err))
    with acc.micro_batch(last=True):
        acc.backward(*lm_loss(model, micro[0]))
    try:
        with acc.micro_batch():  # after the last one: would miss the reduction
            pass
    except RuntimeError as err:
        errors.append(str(err))
    try:
        ga.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), noise=NoiseScale(), sync="micro"
        )
    except ValueError as err:
        errors.append(str(err))
    if rank == 0:
        torch.save(
            {
                "before": before,
                "after": after,
                "stepped": result.stepped,
                "errors": errors,
                "in_window": acc.in_window,
            },
            Path(out) / "spread.pt",
        )


def noise_scale(rank: int, world: int, out: str) -> None:
    """B_simple on linear regression with a known answer (see tests/test_diagnose.py): each
    rank holds 64 samples in 4 micro-batches, the global batch is 128."""
    d, s, delta_norm = 10, 1.5, 0.8
    torch.manual_seed(0)
    w_star = torch.randn(d)
    delta = torch.randn(d)
    delta = delta / delta.norm() * delta_norm
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    model = DistributedDataParallel(model)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise=NoiseScale())

    def loss_fn(model, mb):
        x, y = mb
        return ga.sample_mean(0.5 * (model(x).squeeze(1) - y) ** 2)

    g = torch.Generator().manual_seed(1 + rank)
    found = {}
    for micro in (16, 32):  # 4 micro-batches per rank; then 2, where the reduced window (the
        # global batch) is the only second batch size to fit the local prefix against
        acc.noise = NoiseScale()
        for _ in range(300):
            x = torch.randn(64, d, generator=g)
            y = x @ w_star + s * torch.randn(64, generator=g)
            result = acc.step(ga.split((x, y), micro), loss_fn)
        found[micro] = (result.noise_scale, acc.noise.estimates()[0])
    torch.save(
        {"found": found, "analytic": d + 1 + d * s**2 / delta_norm**2, "true_g2": delta_norm**2},
        Path(out) / f"noise-{rank}.pt",
    )


def forward_outside_and_padding(rank: int, world: int, kind: str, out: str) -> None:
    """Two regressions under DDP and FSDP2. A loss whose forward ran outside
    ``micro_batch()`` and whose backward runs inside must be refused, identically on both
    ranks, before any collective (it once ran one reduction and left the ranks' gradients
    different). And the micro-batch a rank pads with is not kept past its window: only a
    one-sample copy is."""
    model = wrap(make_model(TinyLM), kind)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    micro = split_sizes(padded_lm_batch(seed=40 + rank, n=6), [3, 3])
    errors = []
    loss_sum, count = lm_loss(model, micro[0])  # forward outside the context
    try:
        with acc.micro_batch(last=True):
            acc.backward(loss_sum, count)
    except RuntimeError as err:
        errors.append(str(err))
    dropped = not acc.in_window and all(p.grad is None for p in model.parameters())
    # The same window done right still trains, on both ranks alike.
    result = acc.step(micro, lm_loss)
    flat = torch.cat([p.detach().flatten() for p in full_params(model).values()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)

    held = split_sizes(padded_lm_batch(seed=50 + rank, n=4), [2, 2])
    ids = weakref.ref(held[-1]["input_ids"])  # the micro-batch a later window would pad with
    acc.step(held, lm_loss)
    del held
    gc.collect()
    pad = acc.sync._pad["input_ids"]
    if rank == 0:
        torch.save(
            {
                "errors": errors,
                "dropped": dropped,
                "stepped": result.stepped,
                "spread": float((gathered[0] - gathered[1]).abs().max()),
                "released": ids() is None,
                "pad_shape": list(pad.shape),
            },
            Path(out) / f"outside-{kind}.pt",
        )


def sharded_resume(rank: int, world: int, out: str) -> None:
    """An FSDP2 Accumulator saved with save_sharded at steps 0 and 2 of 4 (AdamW, clipping,
    noise scale: every piece of state a step reads), then restored from each: into fresh
    processes' objects (a resume) and into the trained ones (a rollback)."""
    from gradaccum.checkpoint import load_sharded, save_sharded

    def build():
        model = wrap(make_model(TinyLM), "fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, ga.Accumulator(model, opt, max_grad_norm=1.0, noise=NoiseScale())

    def steps(acc, model, first, last):
        for step in range(first, last):
            batch = padded_lm_batch(seed=40 + 2 * step + rank, n=6)
            acc.step(split_sizes(batch, [2, 4]), lm_loss)
        return full_params(model)

    root = Path(out)
    model, acc = build()
    save_sharded(acc, root / "step-0")
    steps(acc, model, 0, 2)
    save_sharded(acc, root / "step-2")
    straight = steps(acc, model, 2, 4)

    model2, acc2 = build()
    load_sharded(acc2, root / "step-2")
    resumed = steps(acc2, model2, 2, 4)
    state = acc2.state

    load_sharded(acc, root / "step-0")  # back to before the first step, optimizer empty
    empty = not acc.optimizer.state
    replayed = steps(acc, model, 0, 4)
    if rank == 0:
        torch.save(
            {
                "straight": straight,
                "resumed": resumed,
                "replayed": replayed,
                "state": state,
                "empty": empty,
                "files": sorted(p.name for p in (root / "step-2").iterdir()),
            },
            root / "sharded.pt",
        )


def oom_replay(rank: int, world: int, out: str) -> None:
    """DDP with OOM replay, 4 steps of "fewer micro-batches"-style windows; in the injected run
    rank 1 alone runs out of memory in window 2 at any micro-batch above 2 samples."""
    steps = [([2, 4], [3, 4]), ([3, 5], [2, 3]), ([6, 6], [1]), ([4, 4], [1, 1, 1, 1, 1])]

    def train_once(inject: bool):
        model = wrap(make_model(TinyLM), "ddp")
        acc = ga.Accumulator(model, optimizer(model.parameters()), oom=ga.OOMReplay(grow_after=1))
        window = [0]

        def loss_fn(model, mb):
            size = mb["input_ids"].shape[0]
            if inject and rank == 1 and window[0] == 1 and size > 2:
                raise torch.OutOfMemoryError(f"injected: {size} sequences on rank 1")
            return lm_loss(model, mb)

        replays, caps = [], []
        for step, sizes in enumerate(steps):
            window[0] = step
            result = acc.step(my_micro_batches(step, sizes, rank), loss_fn)
            assert result.stepped, result
            replays.append(result.oom_replays)
            caps.append(acc.oom.cap)
        return full_params(model), replays, caps

    injected, replays, caps = train_once(inject=True)
    plain, plain_replays, _ = train_once(inject=False)
    errors = []
    for kind, sync in (("fsdp", "window"), ("ddp", "micro")):
        model = wrap(make_model(TinyLM), kind)
        try:
            ga.Accumulator(model, optimizer(model.parameters()), oom=ga.OOMReplay(), sync=sync)
        except ValueError as err:
            errors.append(str(err))
    if rank == 0:
        torch.save(
            {
                "injected": injected,
                "plain": plain,
                "replays": replays,
                "caps": caps,
                "plain_replays": plain_replays,
                "errors": errors,
            },
            Path(out) / "oom.pt",
        )


def bf16_accumulation(rank: int, world: int, out: str) -> None:
    """N = 32 micro-batches of one sequence per rank, bf16 compute: the gradient the optimizer
    is handed, with fp32 accumulation and with plain bf16 accumulation, under DDP and FSDP2,
    against the exact mean: each micro-batch's own gradient (a plain bf16 copy of the model,
    no gradaccum, no DDP) summed in fp64 over both ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    n = 32
    batch = padded_lm_batch(seed=70 + rank, n=n)
    micro = split_sizes(batch, [1] * n)

    def exact_mean() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        plain = make_model(TinyLM).to(torch.bfloat16)
        sums = {
            name: torch.zeros(p.shape, dtype=torch.float64) for name, p in plain.named_parameters()
        }
        count = torch.zeros((), dtype=torch.float64)
        for mb in micro:
            loss, c = lm_loss(plain, mb)
            loss.backward()
            for name, p in plain.named_parameters():
                sums[name] += p.grad.double()
                p.grad = None
            count += c
        for t in [*sums.values(), count]:
            dist.all_reduce(t)
        return {k: v / count for k, v in sums.items()}

    def handed(model, acc) -> dict[str, torch.Tensor]:
        got = {}
        acc.optimizer.register_step_pre_hook(lambda *_: got.update(full_grads(model)))
        acc.step(micro, lm_loss)
        return got

    exact = exact_mean()
    results = {}
    for accumulate in ("fp32", "bf16"):
        # DDP: bf16 parameters; the Accumulator's fp32 buffers reduced once at the window's
        # end, or bf16 .grad reduced by DDP in the last backward.
        model = DistributedDataParallel(make_model(TinyLM).to(torch.bfloat16))
        precision = ga.Precision(
            "fp32", accumulate_dtype=torch.float32 if accumulate == "fp32" else None
        )
        acc = ga.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.0), precision=precision
        )
        results[f"ddp-{accumulate}"] = handed(model, acc)
        # FSDP2: bf16 compute; FSDP2 accumulates between micro-batches in its reduce dtype.
        model = make_model(TinyLM)
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32 if accumulate == "fp32" else torch.bfloat16,
        )
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
        results[f"fsdp-{accumulate}"] = handed(model, acc)
    if rank == 0:
        torch.save({"exact": exact, **results}, Path(out) / "bf16.pt")


def plan_sync(rank: int, world: int, out: str) -> None:
    """plan(sync="auto") on an FSDP2 GPT under a roomy budget and under one halfway between
    what window and micro sync need at one sample per micro-batch; the planned model (left
    as it was: checked) then trains 2 windows, as a run trains after planning, its per-rank
    peak measured as a training run measures it. (The test fixes glibc's mmap threshold, so the
    resident set follows the tensors: with glibc's moving threshold, freed blocks stay
    resident by chance, megabytes apart from run to run.)"""
    from torch.distributed.fsdp import fully_shard

    from gradaccum.app.recipes.gpt import GPT, GPTConfig
    from gradaccum.app.recipes.stdlib_text import corpus_bytes, full_length_batch
    from gradaccum.memory import TrainingMemory

    shape = GPTConfig(max_len=32, d_model=256, n_heads=4, n_layers=4)
    data = full_length_batch(corpus_bytes(), 8, 32, seed=rank)

    def gpt_loss(model, mb):
        return ga.causal_lm_loss(model(mb["input_ids"]), mb["labels"])

    def fresh():
        torch.manual_seed(0)
        model = GPT(shape)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def planned(budget):
        model, opt = fresh()
        chosen = ga.plan(
            model,
            opt,
            data,
            gpt_loss,
            effective_batch=16,
            budget=budget,
            world_size=world,
            sync="auto",
            meter="rss",
            probe_sizes=[1, 2],
        )
        return chosen, model, opt

    # The process's first steps allocate for good (thread pools, gloo's buffers): not a plan's.
    model, opt = fresh()
    ga.Accumulator(model, opt).step(ga.split(data, 4), gpt_loss)
    roomy = planned("2GB")
    # Window sync holds the whole unsharded gradient G between micro-batches, micro one shard
    # (G/2 on 2 ranks): a budget halfway between the two, at one sample per micro-batch.
    gradient = 4 * sum(p.numel() for p in GPT(shape).parameters())
    squeezed = planned(int((roomy[0].predict(1) - gradient / 4) / (1 - roomy[0].margin)))
    results = {}
    for name, (chosen, model, opt) in (("roomy", roomy), ("squeezed", squeezed)):
        # planning left no trace: the planned model is the fresh one, bit for bit
        untouched = all(
            torch.equal(a, b)
            for a, b in zip(
                full_params(model).values(), full_params(fresh()[0]).values(), strict=True
            )
        )
        acc = ga.Accumulator(model, opt, sync=chosen.sync)
        memory = TrainingMemory(model, "cpu")
        mine = {k: v[: chosen.per_rank_batch] for k, v in data.items()}
        for _ in range(2):
            acc.step(split_sizes(mine, chosen.micro_sizes), gpt_loss)
        peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(peaks, torch.tensor([memory.peak()]))
        results[name] = {
            "plan": chosen,
            "measured": [int(p) for p in peaks],
            "untouched": untouched,
        }
    if rank == 0:
        torch.save(results, Path(out) / "plan_sync.pt")


# Named terms over ranks with different counts: per step, rank 0's and rank 1's micro-batch
# sizes of a global batch of 12 (rank 1 holds more micro-batches, and once none).
TERMS_STEPS = [([3, 2], [1, 4, 2]), ([5, 3], [1, 1, 2]), ([12], [])]


def terms(rank: int, world: int, kind: str, dtype_name: str, out: str) -> None:
    """Three terms with three denominators (tests/terms.py), 3 steps; rank 0 saves the
    gradient the optimizer is handed at each step and the reported term means."""
    import terms as three_terms

    dtype = getattr(torch, dtype_name)
    model = wrap(make_model(TinyLM).to(dtype), kind)
    opt = optimizer(model.parameters())
    handed = []
    opt.register_step_pre_hook(lambda *_: handed.append(full_grads(model)))
    acc = ga.Accumulator(model, opt)
    means = []
    for step, sizes in enumerate(TERMS_STEPS):
        batch = padded_lm_batch(seed=21 + step, n=12)
        start = 0 if rank == 0 else sum(sizes[0])
        mine = {k: v[start : start + sum(sizes[rank])] for k, v in batch.items()}
        result = acc.step(
            split_sizes(mine, sizes[rank]), three_terms.loss_fn, counts=three_terms.counts
        )
        assert result.stepped, result
        means.append(result.terms)
    params = full_params(model)  # a collective under FSDP2: every rank gathers
    if rank == 0:
        torch.save(
            {"grads": handed, "means": means, "params": params},
            Path(out) / f"terms-{kind}-{dtype_name}.pt",
        )


def in_batch(rank: int, world: int, model_name: str, dtype_name: str, out: str) -> None:
    """One in-batch window on 2 ranks holding different numbers of pairs (rank 0 the first
    sizes[0], rank 1 the rest): rank 0 saves the gradient the optimizer is handed."""
    import test_inbatch_ddp as case

    dtype = getattr(torch, dtype_name)
    model, batch, encode, loss = case.setup(model_name, dtype)
    model = DistributedDataParallel(model)
    sizes = case.SIZES[rank]
    start = 0 if rank == 0 else sum(case.SIZES[0])
    mine = {k: v[start : start + sum(sizes)] for k, v in batch.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    handed = []
    opt.register_step_pre_hook(lambda *_: handed.append(full_grads_of(model)))
    result = ga.Accumulator(model, opt).step(split_sizes(mine, sizes), ga.InBatch(encode, loss))
    if rank == 0:
        torch.save(
            {"grads": handed[0], "loss": result.loss, "count": result.count},
            Path(out) / f"inbatch-{model_name}-{dtype_name}.pt",
        )


def full_grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("module."): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def normalizations(rank: int, world: int, dtype_name: str, out: str) -> None:
    """Each normalization helper as one term, one window over 2 ranks: rank 0 holds rows
    0-5 as micro-batches of 4 and 2, rank 1 rows 6-12 as 1, 5, 1; groups of completions span
    the ranks. Rank 0 saves each helper's handed gradient."""
    import test_terms as case

    dtype = getattr(torch, dtype_name)
    batch = case.rl_batch(seed=7, groups=[3, 5, 1, 4])
    sizes = ([4, 2], [1, 5, 1])
    start = 0 if rank == 0 else sum(sizes[0])
    mine = {k: v[start : start + sum(sizes[rank])] for k, v in batch.items()}
    found = {}
    for name, (term, count, _) in case.HELPERS.items():
        model = DistributedDataParallel(make_model(case.TokenMLP).to(dtype))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        handed = []
        opt.register_step_pre_hook(lambda *_, h=handed, m=model: h.append(full_grads_of(m)))
        ga.Accumulator(model, opt).step(
            split_sizes(mine, sizes[rank]),
            lambda m, mb, term=term: {"t": term(m, mb)},
            counts=lambda mb, count=count: {"t": count(mb)},
        )
        found[name] = handed[0]
    # Packed rows: rank 0 the first 3 rows (micro-batches of 1 and 2), rank 1 the rest
    packed = case.pack(case.sequences(seed=9, n=17), row=16)
    rows = packed["input_ids"].shape[0]
    sizes = ([1, 2], [2, rows - 5])
    start = 0 if rank == 0 else 3
    mine = {k: v[start : start + sum(sizes[rank])] for k, v in packed.items()}
    model = DistributedDataParallel(make_model(case.TokenMLP).to(dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handed = []
    opt.register_step_pre_hook(lambda *_: handed.append(full_grads_of(model)))
    ga.Accumulator(model, opt).step(
        split_sizes(mine, sizes[rank]), case.packed_terms, counts=case.packed_counts
    )
    found["packed rows"] = handed[0]
    if rank == 0:
        torch.save(found, Path(out) / f"normalizations-{dtype_name}.pt")


def fp16_first_counts(rank: int, world: int, out: str) -> None:
    """fp16 under DDP, 3 steps, rank 1's first micro-batch holding 2 tokens and rank 0's
    many: fp16's power-of-two pre-scale comes from a first micro-batch's count, and DDP
    adds the ranks' gradients. Rank 0 saves the last step's handed gradient."""
    batch = padded_lm_batch(seed=3, n=12)
    batch["labels"][6, 3:] = -100  # rank 1's first sequence: 2 shifted tokens
    mine = {k: v[rank * 6 : (rank + 1) * 6] for k, v in batch.items()}
    model = DistributedDataParallel(make_model(TinyLM))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handed = []
    opt.register_step_pre_hook(lambda *_: handed.append(full_grads_of(model)))
    acc = ga.Accumulator(model, opt, precision="fp16")
    results = [acc.step(split_sizes(mine, [1, 5]), lm_loss) for _ in range(3)]
    if rank == 0:
        torch.save(
            {"grads": handed[-1], "stepped": [r.stepped for r in results]},
            Path(out) / "fp16.pt",
        )
