"""The (sum, count) loss helpers against torch's own mean losses."""

import pytest
import torch
import torch.nn.functional as F

import gradaccum as ga


def test_causal_lm_loss_counts_shifted_labels():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 1, 2]])
    loss_sum, count = ga.causal_lm_loss(logits, labels)
    # position t predicts label t+1: row 0 has labels 2, 3 (then ignored), row 1 has 4.
    assert int(count) == 2 + 4
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    assert torch.allclose(loss_sum, expected)
    mean = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert torch.allclose(loss_sum / count, mean)


def test_token_cross_entropy_without_shift_and_custom_ignore():
    logits = torch.randn(3, 4, 5)
    labels = torch.tensor([[0, 1, 9, 9], [2, 9, 9, 9], [3, 4, 0, 1]])
    loss_sum, count = ga.token_cross_entropy(logits, labels, ignore_index=9)
    assert int(count) == 7
    assert torch.allclose(
        loss_sum / count, F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), ignore_index=9)
    )
    with pytest.raises(
        ValueError, match=r"labels shape \(3, 3\) does not match logits shape \(3, 4, 5\)"
    ):
        ga.token_cross_entropy(logits, labels[:, :3])
    with pytest.raises(ValueError, match=r"causal_lm_loss expects logits \(batch, seq, vocab\)"):
        ga.causal_lm_loss(logits[0], labels[0])


def test_low_precision_logits_are_summed_in_fp32_and_fp64_stays_fp64():
    logits = torch.randn(2, 6, 5)
    labels = torch.randint(0, 5, (2, 6))
    assert ga.token_cross_entropy(logits.bfloat16(), labels)[0].dtype == torch.float32
    assert ga.token_cross_entropy(logits.double(), labels)[0].dtype == torch.float64


def test_sample_mean_matches_a_full_batch_mean():
    pred, target = torch.randn(6, 4), torch.randn(6, 4)
    loss_sum, count = ga.sample_mean(F.mse_loss(pred, target, reduction="none"))
    assert count == 6
    assert torch.allclose(loss_sum / count, F.mse_loss(pred, target))
    assert ga.sample_mean(torch.zeros(0, 4))[1] == 0
    with pytest.raises(ValueError, match="reduction='none'"):
        ga.sample_mean(F.mse_loss(pred, target))
