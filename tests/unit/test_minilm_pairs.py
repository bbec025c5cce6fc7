"""The minilm-pairs recipe: its pairs (no paragraph in two pairs, held-out modules apart), its
held-out retrieval, and its loss: in-batch negatives over the whole window."""

from __future__ import annotations

import collections

import pytest
import torch
from frameworks import rel_err
from helpers import capture_step_grads

import gradaccum as ga
from gradaccum.app.recipes import get_recipe, minilm_pairs

# Building the pairs parses every stdlib module's docstrings (seconds), and the window test
# runs MiniLM: the slow tier (CI runs it after make test). The exactness of ga.InBatch on
# MiniLM is in make test (test_inbatch.py).
pytestmark = pytest.mark.slow


def test_no_paragraph_is_in_two_pairs_and_held_out_modules_stay_apart():
    train, held = minilm_pairs.pairs("train"), minilm_pairs.pairs("held_out")
    assert len(train) > 1024 and len(held) > 100  # a step of 1,024 pairs is within an epoch
    for name, found in (("train", train), ("held_out", held)):
        texts = collections.Counter(t for pair in found for t in pair)
        # chained pairs (a, b), (b, c) would make one pair's positive the next one's query,
        # the exact answer to a retrieval
        # (as pairs of every two consecutive paragraphs did, for every pair but a module's
        # last); a paragraph that a module repeats can still chain, rarely
        chained = sum(1 for (_, b), (c, _) in zip(found, found[1:], strict=False) if b == c)
        assert chained < len(found) / 100, (name, chained)
        assert texts.most_common(1)[0][1] < 20, name
    assert set(train).isdisjoint(held)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return minilm_pairs.PairEncoder().eval()


def test_held_out_retrieval_is_measured_against_every_held_out_positive(encoder):
    data = minilm_pairs.PairData(seed=0)
    got = data.evaluate(encoder, micro_size=32, limit=64)
    assert set(got) == {"loss", "accuracy"}
    # pretrained: well above chance (1 in 64) and below perfect
    assert 2 / 64 < got["accuracy"] < 1.0
    assert 0 < got["loss"] < float("inf")


def test_the_recipes_window_is_the_full_batch_of_pairs(encoder):
    """32 pairs as 4 micro-batches of 8 through the recipe's loss (ga.InBatch): the gradient
    of the ranking loss over all 32, every other pair a negative (the recipe's own loss
    called on the whole batch, which is torch alone on it)."""
    recipe = get_recipe("minilm-pairs")
    assert isinstance(recipe.loss_fn, ga.InBatch)
    batch = minilm_pairs.PairData(seed=0).batch(0, 32)
    start = {k: v.clone() for k, v in encoder.state_dict().items()}
    encoder.zero_grad(set_to_none=True)
    query, doc = minilm_pairs.embed(encoder, batch)
    loss_sum, count = minilm_pairs.ranking_loss((query, doc))
    (loss_sum / count).backward()
    want = {n: p.grad.clone() for n, p in encoder.named_parameters()}
    encoder.zero_grad(set_to_none=True)
    encoder.load_state_dict(start)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.0)
    seen = capture_step_grads(opt, encoder)
    ga.Accumulator(encoder, opt).step(ga.split(batch, 8), recipe.loss_fn)
    assert rel_err(seen[0], want) <= 1e-6
