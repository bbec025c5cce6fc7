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


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_hugging_face_model_that_caches_keys_is_checkpointed_exactly(kind, attention):
    """A Hugging Face model with use_cache on (their configs' default): a block recomputed in
    backward appended its keys and values to the cache a second time, so eager attention
    failed on its mask (GPT-2 and Llama) and the cache held every layer's keys through the
    forward. Checkpointed, it gives the plain model's gradient (float64, the same dropout
    masks); undone, the config caches again."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=97,
                                         n_positions=64)  # fmt: skip
        make = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        make = transformers.LlamaForCausalLM
    config._attn_implementation = attention
    torch.manual_seed(0)
    plain = make(config).double().train()
    checkpointed = make(config).double().train()
    checkpointed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(model):
        torch.manual_seed(7)  # the same dropout masks for both
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    assert checkpointed.config.use_cache
    ga.enable_checkpointing(checkpointed)
    assert not checkpointed.config.use_cache
    assert max_rel_err(grads(checkpointed), grads(plain)) <= 1e-12
    ga.disable_checkpointing(checkpointed)
    assert checkpointed.config.use_cache
