"""Named terms, each its own mean (window.Tally's terms, Accumulator.step(counts=...)), and the
normalization helpers, against full-batch references written with torch alone.

Each equivalence prints the naive per-micro-batch mean's error beside gradaccum's: the
number the contract exists to remove."""

from __future__ import annotations

import pytest
import terms
import torch
import torch.nn.functional as F
from helpers import (
    UNEVEN_SIZES,
    TinyLM,
    capture_step_grads,
    make_model,
    max_rel_err,
    padded_lm_batch,
    split_sizes,
)
from support.faults import inject_oom
from torch import nn

import gradaccum as ga

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def full_batch_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def window_grads(factory, dtype, micro_batches, loss_fn, counts, **acc):
    model = make_model(factory).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    result = ga.Accumulator(model, optimizer, **acc).step(micro_batches, loss_fn, counts=counts)
    assert result.stepped and len(seen) == 1
    return seen[0], result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n", [2, 4, 7])
def test_three_terms_with_three_denominators_equal_the_full_batch(dtype, n):
    batch = padded_lm_batch(seed=3)
    model = make_model(TinyLM).to(dtype)
    expected = full_batch_grads(model, terms.reference(model, batch))
    micro_batches = split_sizes(batch, UNEVEN_SIZES[n])

    got, result = window_grads(TinyLM, dtype, micro_batches, terms.loss_fn, terms.counts)

    naive_model = make_model(TinyLM).to(dtype)
    naive = max_rel_err(
        full_batch_grads(naive_model, terms.naive_loss(naive_model, micro_batches)), expected
    )
    err = max_rel_err(got, expected)
    print(f"three terms, N={n} {dtype}: gradaccum {err:.1e}, per-micro-batch mean {naive:.2e}")
    assert err <= TOL[dtype], f"gradient relative error {err:.2e}"
    assert naive > 1e-3  # the naive mean is measurably wrong on this batch: the test can fail
    with torch.no_grad():
        means = {k: v.item() for k, v in terms.reference_terms(model, batch).items()}
    assert result.terms == pytest.approx(means, rel=TOL[dtype] * 10)
    assert result.loss == pytest.approx(sum(terms.WEIGHTS[k] * means[k] for k in means), rel=1e-6)
    assert result.count == int((batch["labels"][:, 1:] != -100).sum())  # the first term's


def test_a_ragged_last_window_and_a_momentum_optimizer_follow_the_full_batch_loop():
    """21 sequences in windows of 8, 8 and 5 (split unevenly), SGD with momentum, float64:
    every step's gradient and the final parameters against the plain full-batch loop."""
    dtype = torch.float64
    data = padded_lm_batch(seed=5, n=21)
    windows = [(0, 8, [3, 5]), (8, 16, [1, 1, 6]), (16, 21, [4, 1])]

    ref = make_model(TinyLM).to(dtype)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for start, stop, _ in windows:
        batch = {k: v[start:stop] for k, v in data.items()}
        ref_opt.zero_grad(set_to_none=True)
        terms.reference(ref, batch).backward()
        expected.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        ref_opt.step()

    model = make_model(TinyLM).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = capture_step_grads(opt, model)
    acc = ga.Accumulator(model, opt)
    for start, stop, sizes in windows:
        batch = {k: v[start:stop] for k, v in data.items()}
        acc.step(split_sizes(batch, sizes), terms.loss_fn, counts=terms.counts)
    for step, (got, want) in enumerate(zip(seen, expected, strict=True)):
        assert max_rel_err(got, want) <= 1e-12, f"step {step}"
    final = {n: p.detach() for n, p in model.named_parameters()}
    assert max_rel_err(final, {n: p.detach() for n, p in ref.named_parameters()}) <= 1e-12


def test_the_manual_window_computes_what_step_computes():
    batch = padded_lm_batch(seed=4)
    micro_batches = split_sizes(batch, UNEVEN_SIZES[4])
    by_step, _ = window_grads(TinyLM, torch.float64, micro_batches, terms.loss_fn, terms.counts)

    model = make_model(TinyLM).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(opt, model)
    acc = ga.Accumulator(model, opt)
    totals: dict[str, int] = {}
    for mb in micro_batches:
        for k, v in terms.counts(mb).items():
            totals[k] = totals.get(k, 0) + int(v)
    acc.begin_window(totals)
    for i, mb in enumerate(micro_batches):
        with acc.micro_batch(last=i == len(micro_batches) - 1):
            acc.backward(terms.loss_fn(model, mb))
    result = acc.end_window()
    assert result.terms is not None and set(result.terms) == {"ce", "seq", "z"}
    assert all(torch.equal(seen[0][k], by_step[k]) for k in by_step)


def test_oom_replay_of_a_window_of_terms_keeps_the_step_exact():
    batch = padded_lm_batch(seed=6, n=12)
    model = make_model(TinyLM).double()
    expected = full_batch_grads(model, terms.reference(model, batch))
    got, result = window_grads(
        TinyLM,
        torch.float64,
        split_sizes(batch, [6, 6]),
        inject_oom(terms.loss_fn, 2),
        terms.counts,
        oom=ga.OOMReplay(),
    )
    assert result.oom_replays >= 1
    assert max_rel_err(got, expected) <= 1e-12


# -- the normalization helpers, each as one term ---------------------------------------------


class TokenMLP(nn.Module):
    """Per-token model (no mixing across positions): packed and unpacked rows give the same
    per-token outputs, so a packing test checks the counting alone."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tok(ids))


def rl_batch(seed: int, groups: list[int], length: int = 9) -> dict[str, torch.Tensor]:
    """Completions grouped by prompt (``groups``: each group's size), varying lengths,
    advantages per completion, as a GRPO-style loss sees them."""
    g = torch.Generator().manual_seed(seed)
    n = sum(groups)
    ids = torch.randint(0, 32, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    size = torch.tensor([s for s in groups for _ in range(s)])
    group = torch.tensor([i for i, s in enumerate(groups) for _ in range(s)])
    return {
        "ids": ids,
        "mask": mask,
        "advantage": torch.randn(n, generator=g),
        "group_size": size,
        "group": group,
    }


def token_losses(model, mb):
    """A policy-gradient surrogate per token: -advantage x log p(token)."""
    logp = torch.log_softmax(model(mb["ids"]), dim=-1)
    taken = logp.gather(-1, mb["ids"][..., None]).squeeze(-1)
    return -mb["advantage"][:, None].to(taken.dtype) * taken


HELPERS = {
    # name: (gradaccum term, its count, the full-batch mean written with torch alone)
    "per_token": (
        lambda m, mb: ga.per_token(token_losses(m, mb), mb["mask"]),
        lambda mb: ga.token_count(mb["mask"]),
        lambda losses, b: losses[b["mask"]].mean(),
    ),
    "per_sequence": (
        lambda m, mb: ga.per_sequence(token_losses(m, mb), mb["mask"]),
        lambda mb: ga.sequence_count(mb["mask"]),
        lambda losses, b: ((losses * b["mask"]).sum(1) / b["mask"].sum(1)).mean(),
    ),
    "per_group": (
        lambda m, mb: ga.per_group(token_losses(m, mb), mb["mask"], mb["group_size"]),
        lambda mb: ga.group_count(mb["mask"], mb["group_size"]),
        lambda losses, b: torch.stack(
            [
                ((losses * b["mask"]).sum(1) / b["mask"].sum(1))[b["group"] == g].mean()
                for g in b["group"].unique()
            ]
        ).mean(),
    ),
    "constant_normalizer": (
        lambda m, mb: ga.constant_normalizer(token_losses(m, mb), mb["mask"], 9),
        lambda mb: mb["mask"].shape[0],
        lambda losses, b: ((losses * b["mask"]).sum(1) / 9).mean(),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_each_normalization_equals_its_full_batch_definition(helper, dtype):
    """Groups of 3, 5, 1 and 4 completions (13 rows) over micro-batches of 4, 2, 5 and 2:
    groups span micro-batches, sequences have different lengths."""
    term, count, definition = HELPERS[helper]
    batch = rl_batch(seed=7, groups=[3, 5, 1, 4])
    micro_batches = split_sizes(batch, [4, 2, 5, 2])
    model = make_model(TokenMLP).to(dtype)
    expected = full_batch_grads(model, definition(token_losses(model, batch), batch))
    got, result = window_grads(
        TokenMLP,
        dtype,
        micro_batches,
        lambda m, mb: {"pg": term(m, mb)},
        lambda mb: {"pg": count(mb)},
    )
    naive_model = make_model(TokenMLP).to(dtype)
    naive_loss = sum(definition(token_losses(naive_model, mb), mb) for mb in micro_batches) / 4
    naive = max_rel_err(full_batch_grads(naive_model, naive_loss), expected)
    err = max_rel_err(got, expected)
    print(f"{helper} {dtype}: gradaccum {err:.1e}, per-micro-batch mean {naive:.2e}")
    assert err <= TOL[dtype], f"{helper}: gradient relative error {err:.2e}"
    with torch.no_grad():
        mean = definition(token_losses(model, batch), batch).item()
    assert result.terms["pg"] == pytest.approx(mean, rel=1e-6)


def test_a_single_normalization_needs_no_counts():
    """One term is the (loss_sum, count) pair: its count is learned as the window runs."""
    batch = rl_batch(seed=8, groups=[2, 2, 3, 3, 3])
    model = make_model(TokenMLP).double()
    losses = token_losses(model, batch)
    expected = full_batch_grads(
        model, ((losses * batch["mask"]).sum(1) / batch["mask"].sum(1)).mean()
    )
    got, _ = window_grads(
        TokenMLP,
        torch.float64,
        split_sizes(batch, [5, 1, 7]),
        lambda m, mb: ga.per_sequence(token_losses(m, mb), mb["mask"]),
        None,
    )
    assert max_rel_err(got, expected) <= 1e-12


# -- packed rows -----------------------------------------------------------------------------


def sequences(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 32, (int(k),), generator=g) for k in torch.randint(2, 9, (n,), generator=g)
    ]


def pack(seqs: list[torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """Sequences laid end to end in rows of ``row`` tokens (a sequence never split), padding
    at a row's end; position ids restart at 0 for each sequence (padding continues them)."""
    rows, current = [], []
    for s in seqs:
        if sum(map(len, current)) + len(s) > row:
            rows.append(current)
            current = []
        current.append(s)
    rows.append(current)
    ids = torch.zeros(len(rows), row, dtype=torch.long)
    labels = torch.full((len(rows), row), -100)
    pos = torch.zeros(len(rows), row, dtype=torch.long)
    for r, parts in enumerate(rows):
        at = 0
        for s in parts:
            ids[r, at : at + len(s)] = s
            labels[r, at : at + len(s)] = s
            pos[r, at : at + len(s)] = torch.arange(len(s))
            at += len(s)
        pos[r, at:] = torch.arange(1, row - at + 1) + (pos[r, at - 1] if at else 0)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def unpacked_reference(model, seqs, per_sequence: bool) -> torch.Tensor:
    """Each sequence on its own, next-token cross-entropy: the mean over every target token,
    or over each sequence's mean."""
    losses = [F.cross_entropy(model(s[None])[0, :-1], s[1:], reduction="none") for s in seqs]
    if per_sequence:
        return torch.stack([x.mean() for x in losses]).mean()
    return torch.cat(losses).mean()


def packed_terms(model, mb):
    logits = model(mb["input_ids"])
    labels = ga.loss.next_token_labels(mb["labels"], position_ids=mb["position_ids"])
    mask = labels != -100
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels.clamp(min=0).reshape(-1),
        reduction="none",
    ).reshape(labels.shape)
    ids = ga.sequence_ids(mask, position_ids=mb["position_ids"][:, 1:])
    return {
        "tokens": ga.causal_lm_loss(logits, mb["labels"], position_ids=mb["position_ids"]),
        "sequences": ga.per_sequence(losses, mask, sequence_ids=ids),
    }


def packed_counts(mb):
    labels = ga.loss.next_token_labels(mb["labels"], position_ids=mb["position_ids"])
    mask = labels != -100
    ids = ga.sequence_ids(mask, position_ids=mb["position_ids"][:, 1:])
    return {"tokens": ga.token_count(mask), "sequences": ga.sequence_count(mask, sequence_ids=ids)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_packed_rows_count_what_the_sequences_count_unpacked(dtype):
    """17 sequences packed into rows of 16 tokens, the rows split into uneven micro-batches:
    the token-level and the per-sequence means (and their gradients) equal those of the
    sequences one by one; counting across the boundaries (a sequence's last token predicting
    the next one's first) is what inflated packed gradients elsewhere."""
    seqs = sequences(seed=9, n=17)
    packed = pack(seqs, row=16)
    assert packed["input_ids"].shape[0] >= 5
    rows = packed["input_ids"].shape[0]
    sizes = [1, rows - 3, 2]
    micro_batches = split_sizes(packed, sizes)
    model = make_model(TokenMLP).to(dtype)
    expected = full_batch_grads(
        model,
        unpacked_reference(model, seqs, per_sequence=False)
        + unpacked_reference(model, seqs, per_sequence=True),
    )
    got, result = window_grads(TokenMLP, dtype, micro_batches, packed_terms, packed_counts)
    assert max_rel_err(got, expected) <= TOL[dtype]
    assert result.count == sum(len(s) - 1 for s in seqs)
    # without the boundaries, each row's junctions count as targets: the naive count is off
    naive = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches)
    assert naive == result.count + len(seqs) - rows


def test_sequence_ids_from_position_ids_and_from_cumulative_lengths_agree():
    seqs = sequences(seed=10, n=6)
    packed = pack(seqs, row=20)
    mask = packed["labels"] != -100
    by_positions = ga.sequence_ids(mask, position_ids=packed["position_ids"])
    # cu_seqlens over the flattened rows: each sequence, and each row's padding as its own
    starts = (packed["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    rows = range(0, mask.numel(), mask.shape[1])
    cu_seqlens = torch.tensor(sorted({*starts, *rows, mask.numel()}))
    by_cu = ga.sequence_ids(mask, cu_seqlens=cu_seqlens)
    assert torch.equal(by_positions >= 0, mask)
    assert torch.equal(by_positions, by_cu)
    assert int(ga.sequence_count(mask, sequence_ids=by_positions)) == len(seqs)


# -- refusals --------------------------------------------------------------------------------


def test_terms_without_counts_are_refused_in_one_line():
    batch = padded_lm_batch(seed=3)
    model = make_model(TinyLM)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"counts were not given.*step\(\.\.\., counts=fn\)"):
        acc.step(split_sizes(batch, [6, 7]), terms.loss_fn)
    assert not acc.in_window and all(p.grad is None for p in model.parameters())


def test_counts_that_differ_from_the_losses_drop_the_window_naming_the_term():
    batch = padded_lm_batch(seed=3)
    model = make_model(TinyLM)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def wrong(mb):
        return {**terms.counts(mb), "z": 1}

    with pytest.raises(ValueError, match=r"z: \d+ counted by the loss, 2 given"):
        acc.step(split_sizes(batch, [6, 7]), terms.loss_fn, counts=wrong)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert acc.state.optimizer_steps == 0 and not acc.in_window


def test_a_term_missing_from_the_counts_or_a_changing_weight_is_named():
    batch = padded_lm_batch(seed=3)
    model = make_model(TinyLM)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"not counted \['z'\]"):
        acc.step(
            split_sizes(batch, [6, 7]),
            terms.loss_fn,
            counts=lambda mb: {k: v for k, v in terms.counts(mb).items() if k != "z"},
        )
    calls = iter(range(10))

    def drifting(model, mb):
        out = terms.loss_fn(model, mb)
        out["z"] = (*out["z"][:2], 0.01 * (1 + next(calls)))
        return out

    with pytest.raises(ValueError, match=r"term 'z' has weight 0.02 in micro-batch 1 but 0.01"):
        acc.step(split_sizes(batch, [6, 7]), drifting, counts=terms.counts)
    with pytest.raises(ValueError, match=r"term 'ce': count must be a non-negative number, got -1"):
        acc.begin_window({"ce": -1})
    assert not acc.in_window


# -- the other paths: a framework's window, a pipeline's -------------------------------------


def test_a_frameworks_window_of_terms_computes_what_step_computes():
    """A framework's loop (the transformers Trainer's order): the window begun with the
    counts, each micro-batch's terms recorded before its backward, the end's one division."""
    from gradaccum.integrations.window import FrameworkWindow

    batch = padded_lm_batch(seed=4)
    micro_batches = split_sizes(batch, UNEVEN_SIZES[4])
    model = make_model(TinyLM).double()
    expected = full_batch_grads(model, terms.reference(model, batch))
    window = FrameworkWindow(model, None)
    window.begin(ga.loss.window_counts(terms.counts, micro_batches))
    for mb in micro_batches:
        loss, _ = window.record(terms.loss_fn(model, mb))
        loss.backward()
    end = window.end([p.grad for p in model.parameters()])
    got = {n: p.grad for n, p in model.named_parameters()}
    assert max_rel_err(got, expected) <= 1e-12
    assert set(end.terms) == {"ce", "seq", "z"}


def test_a_pipeline_window_of_terms_computes_the_full_batch(one_process_group):
    """A pipeline of one stage (the schedule cuts the batch into 4 micro-batches itself):
    a token term and a per-sequence term (weight 0.5), against torch alone."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.pipeline import PipelineWindow

    batch = padded_lm_batch(seed=5, n=12)
    ids, labels = batch["input_ids"], batch["labels"]

    def pipe_loss(logits, target):
        token = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            target[:, 1:].clamp(min=0).reshape(-1),
            reduction="none",
        ).reshape(target[:, 1:].shape)
        mask = target[:, 1:] != -100
        return {"ce": ga.per_token(token, mask), "seq": (*ga.per_sequence(token, mask), 0.5)}

    def counts(target):
        mask = target[:, 1:] != -100
        return {"ce": ga.token_count(mask), "seq": ga.sequence_count(mask)}

    reference = make_model(TinyLM).double()
    logits = reference(ids)[:, :-1]
    token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels[:, 1:].clamp(min=0).reshape(-1),
        reduction="none",
    ).reshape(labels[:, 1:].shape)
    mask = labels[:, 1:] != -100
    per_row = (token * mask).sum(1) / mask.sum(1)
    expected = full_batch_grads(reference, token[mask].mean() + 0.5 * per_row.mean())

    model = make_model(TinyLM).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture_step_grads(opt, model)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    pipe = PipelineWindow(stage, opt, pipe_loss, 4, schedule="gpipe")
    result = pipe.step(ids, target=labels, counts=counts)
    assert max_rel_err(captured[0], expected) <= 1e-12
    assert result.terms["seq"] == pytest.approx(per_row.mean().item(), rel=1e-12)
    with pytest.raises(TypeError, match="counts were not given"):
        pipe.step(ids, target=labels)


@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_each_normalization_follows_the_full_batch_loop_through_a_ragged_last_window(helper):
    """13 rows in windows of 5, 5 and 3 (the last one ragged), each split unevenly, SGD with
    momentum, float64: every step's gradient against the plain full-batch loop's."""
    term, count, definition = HELPERS[helper]
    data = rl_batch(seed=12, groups=[2, 3, 4, 4])
    windows = [(0, 5, [2, 3]), (5, 10, [4, 1]), (10, 13, [1, 2])]
    ref = make_model(TokenMLP).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = make_model(TokenMLP).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = capture_step_grads(opt, model)
    acc = ga.Accumulator(model, opt)
    for start, stop, sizes in windows:
        batch = {k: v[start:stop] for k, v in data.items()}
        # group sizes are the window's: the group cut by a window's end counts its rows in
        # each window, as the reference's groups do
        batch["group_size"] = torch.bincount(batch["group"])[batch["group"]]
        ref_opt.zero_grad(set_to_none=True)
        definition(token_losses(ref, batch), batch).backward()
        want = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        acc.step(
            split_sizes(batch, sizes),
            lambda m, mb: {"t": term(m, mb)},
            counts=lambda mb: {"t": count(mb)},
        )
        assert max_rel_err(seen[-1], want) <= 1e-12, (helper, start)
