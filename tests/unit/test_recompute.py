"""Activation checkpointing: the same gradient, the same state_dict keys, undone cleanly."""

import pytest
import torch
from helpers import GroupNormCNN, TinyLM, deep_lm_setup, make_model, max_rel_err

import gradaccum as ga


def test_checkpointing_gives_the_same_gradient_and_is_undone():
    model, batch, loss_fn = deep_lm_setup(dropout=0.2)
    reference = make_model(lambda: TinyLM(d=32, layers=3, max_len=64, dropout=0.2))

    def grads(m):
        torch.manual_seed(7)  # the same dropout masks for both
        m.zero_grad(set_to_none=True)
        loss_sum, count = loss_fn(m, batch)
        (loss_sum / count).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    names = ga.enable_checkpointing(model)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(model.state_dict()) == list(reference.state_dict())  # keys unchanged
    assert max_rel_err(grads(model), grads(reference)) <= 1e-6
    ga.disable_checkpointing(model)
    assert not ga.recompute.checkpointing_enabled(model)
    with pytest.raises(ValueError, match="GroupNormCNN has no repeated blocks"):
        ga.enable_checkpointing(make_model(GroupNormCNN))
