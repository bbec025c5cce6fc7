"""In-batch negatives (ga.InBatch): one window of cached-gradient accumulation against the
full batch's contrastive loss written with torch alone, where every sample's negatives are
the whole batch. Plain accumulation's error (each micro-batch's own negatives) is printed
beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from frameworks import rel_err
from helpers import capture_step_grads, max_rel_err, split_sizes
from support.faults import inject_oom
from torch import nn

import gradaccum as ga

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


class Encoder(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mlp = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 8)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).mean(1))


def pairs(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randint(0, 50, (n, 6), generator=g),
        "doc": torch.randint(0, 50, (n, 6), generator=g),
        "label": torch.randint(0, 4, (n,), generator=g),
    }


def embed(model, mb):
    return model(mb["query"]), model(mb["doc"])


def ranking_loss(parts):
    """Multiple-negatives ranking: each query against every document of the batch."""
    q, d = parts
    scores = 20.0 * F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T
    return F.cross_entropy(scores, torch.arange(len(q)), reduction="sum"), len(q)


def embed_labelled(model, mb):
    return {"z": model(mb["query"]), "label": mb["label"]}


def supervised_loss(parts):
    """InfoNCE with labels (supervised contrastive): each sample's positives are the other
    samples of its label, its negatives all the rest of the batch."""
    z, label = F.normalize(parts["z"], dim=-1), parts["label"]
    logits = 10.0 * z @ z.T
    self_mask = torch.eye(len(z), dtype=torch.bool)
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    positive = (label[:, None] == label[None, :]) & ~self_mask
    has = positive.any(dim=1)
    per_sample = -(log_prob.masked_fill(~positive, 0).sum(1)[has] / positive.sum(1)[has])
    return per_sample.sum(), int(has.sum())


LOSSES = {
    "ranking": (embed, ranking_loss),
    "supervised contrastive": (embed_labelled, supervised_loss),
}


def full_batch(model, batch, embedder, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_sum, count = loss(embedder(model, batch))
    (loss_sum / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def make(dtype, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return Encoder(dropout).to(dtype)


def handed(model, micro_batches, loss_fn, **acc):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(opt, model)
    result = ga.Accumulator(model, opt, **acc).step(micro_batches, loss_fn)
    assert result.stepped and len(seen) == 1
    return seen[0], result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_window_equals_the_full_batch_with_all_its_negatives(name, dtype):
    embedder, loss = LOSSES[name]
    batch = pairs(seed=1, n=29)
    micro_batches = split_sizes(batch, [5, 11, 1, 8, 4])
    expected = full_batch(make(dtype), batch, embedder, loss)
    got, result = handed(make(dtype), micro_batches, ga.InBatch(embedder, loss))
    plain, _ = handed(make(dtype), micro_batches, lambda m, mb: loss(embedder(m, mb)))
    err, naive = max_rel_err(got, expected), max_rel_err(plain, expected)
    print(f"{name} {dtype}: cached gradients {err:.1e}, plain accumulation {naive:.2e}")
    assert err <= TOL[dtype]
    assert naive > 1e-2  # plain accumulation sees other negatives: the test can fail
    with torch.no_grad():
        loss_sum, count = loss(embedder(make(dtype), batch))
    assert result.count == count
    assert result.loss == pytest.approx(float(loss_sum) / count, rel=TOL[dtype] * 10)


def test_dropout_draws_the_same_masks_in_both_passes():
    """With dropout on, the window's gradient is the one of the micro-batches embedded in
    turn with their graphs (the same random stream) and one loss over all of them: each
    micro-batch's second pass replays its first pass's masks."""
    batch = pairs(seed=2, n=20)
    micro_batches = split_sizes(batch, [7, 6, 7])
    reference = make(torch.float64, dropout=0.3)
    torch.manual_seed(11)
    parts = [embed(reference, mb) for mb in micro_batches]
    loss_sum, count = ranking_loss(tuple(torch.cat(p) for p in zip(*parts, strict=True)))
    (loss_sum / count).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}

    model = make(torch.float64, dropout=0.3)
    torch.manual_seed(11)
    got, _ = handed(model, micro_batches, ga.InBatch(embed, ranking_loss))
    assert max_rel_err(got, expected) <= 1e-12
    # and the stream goes on as if each micro-batch had been embedded once
    after = torch.rand(3)
    torch.manual_seed(11)
    for mb in micro_batches:
        embed(reference, mb)
    assert torch.equal(after, torch.rand(3))


def test_an_out_of_memory_window_replays_smaller_and_stays_exact():
    batch = pairs(seed=3, n=16)
    expected = full_batch(make(torch.float64), batch, embed, ranking_loss)
    oom_embed = inject_oom(embed, 3)
    got, result = handed(
        make(torch.float64),
        split_sizes(batch, [8, 8]),
        ga.InBatch(oom_embed, ranking_loss),
        oom=ga.OOMReplay(),
    )
    assert result.oom_replays >= 1
    assert max_rel_err(got, expected) <= 1e-12


def test_what_an_in_batch_loss_cannot_be_is_said_in_one_line():
    with pytest.raises(TypeError, match="InBatch's loss must be callable"):
        ga.InBatch(embed, 3)
    model = make(torch.float32)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="embed must return a tensor, or a tuple"):
        acc.step([pairs(0, 4)], ga.InBatch(lambda m, mb: "nope", ranking_loss))
    with pytest.raises(TypeError, match="counts= is for named terms"):
        acc.step([pairs(0, 4)], ga.InBatch(embed, ranking_loss), counts=lambda mb: {})
    assert not acc.in_window and all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_minilm_window_equals_the_full_batch():
    """The pretrained MiniLM (the minilm recipe's encoder, dropout off), 16 pairs of docstring
    paragraphs, micro-batches of 5, 5, 6."""
    from gradaccum.app.recipes import minilm

    verbs = ["Return", "Parse", "Write", "Close"]
    things = ["the queue", "a socket", "the header", "an archive", "the file", "a message"]
    things += ["the buffer", "a thread"]
    texts = [
        f"{v} {t} and report item {i}."
        for i, (v, t) in enumerate((v, t) for v in verbs for t in things)
    ][:32]
    q_ids, q_mask = minilm.encode(texts[0::2])
    d_ids, d_mask = minilm.encode(texts[1::2])
    batch = {"q": q_ids, "qm": q_mask, "d": d_ids, "dm": d_mask}
    assert len(q_ids) == 16

    def encode(model, mb):
        return model.embed(mb["q"], mb["qm"]), model.embed(mb["d"], mb["dm"])

    torch.manual_seed(0)
    model = minilm.DocstringClassifier().eval()
    model.head.requires_grad_(False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expected = full_batch(model, batch, encode, ranking_loss)
    model.load_state_dict(start)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    seen = capture_step_grads(opt, model)
    micro_batches = split_sizes(batch, [5, 5, 6])
    ga.Accumulator(model, opt).step(micro_batches, ga.InBatch(encode, ranking_loss))
    # The whole gradient as one vector (attention's key biases have an exact gradient of
    # zero, rounding noise in both: tests/unit/test_minilm.py says why)
    err = rel_err(seen[0], expected)
    print(f"MiniLM, 16 pairs as 5 + 5 + 6: cached gradients {err:.1e}")
    assert err <= 1e-6
