"""In-batch negatives over 2 real gloo processes under DDP: each rank embeds its own pairs,
the embeddings are gathered so every rank's negatives are the whole global batch, and the
gradient handed to the optimizer equals one process's full batch (torch alone). The ranks
hold different numbers of pairs in different numbers of micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import workers
from launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
import test_inbatch as small  # noqa: E402
from frameworks import rel_err  # noqa: E402
from helpers import max_rel_err  # noqa: E402

SIZES = ([5, 4], [2, 6, 3])  # rank 0's and rank 1's micro-batches: 9 and 11 pairs


def setup(model_name: str, dtype: torch.dtype):
    """The model, the global batch of 20 pairs, the embedding and the loss."""
    if model_name == "encoder":
        return small.make(dtype), small.pairs(seed=4, n=20), small.embed, small.ranking_loss
    from gradaccum.app.recipes import minilm

    texts = [t for t, _, _ in minilm.corpus()["train"][:40]]
    q_ids, q_mask = minilm.encode(texts[0::2])
    d_ids, d_mask = minilm.encode(texts[1::2])
    batch = {"q": q_ids, "qm": q_mask, "d": d_ids, "dm": d_mask}

    def encode(model, mb):
        return model(mb["q"], mb["qm"]), model(mb["d"], mb["dm"])

    torch.manual_seed(0)
    model = Embedder(minilm.DocstringClassifier().eval().to(dtype))
    return model, batch, encode, small.ranking_loss


class Embedder(torch.nn.Module):
    """MiniLM's encoder whose forward embeds (the forward DDP wraps)."""

    def __init__(self, classifier) -> None:
        super().__init__()
        self.encoder = classifier.encoder
        self._embed = type(classifier).embed

    def forward(self, ids, mask):
        return self._embed(self, ids, mask)


def reference(model_name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model, batch, encode, loss = setup(model_name, dtype)
    loss_sum, count = loss(encode(model, batch))
    (loss_sum / count).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model_name", "dtype"),
    [
        ("encoder", "float32"),
        ("encoder", "float64"),
        # two MiniLMs: the slow tier. In float64, where float32's rounding of a 22M-parameter
        # gradient (1e-6 of it, order-dependent) cannot hide an arithmetic error
        pytest.param("minilm", "float64", marks=pytest.mark.slow),
    ],
)
def test_in_batch_window_over_two_ranks_equals_the_full_batch(tmp_path, model_name, dtype):
    launch(workers.in_batch, model_name, dtype, str(tmp_path), timeout=120)
    got = torch.load(tmp_path / f"inbatch-{model_name}-{dtype}.pt", weights_only=True)
    want = reference(model_name, getattr(torch, dtype))
    assert got["count"] == 20
    if model_name == "minilm":  # the whole gradient as one vector (key biases: zero + noise)
        err = rel_err(got["grads"], want)
    else:
        err = max_rel_err(got["grads"], want)
    print(f"{model_name} {dtype} on 2 ranks: {err:.1e}")
    assert err <= (1e-12 if dtype == "float64" else 1e-6)
