"""gradaccum.planning.estimate.zero: a DeepSpeed configuration read as Hugging Face's Trainer
fills it, what is refused in one line, and the modelled engine's bytes on a model small
enough to count by hand (the check against a real DeepSpeed engine is
tests/integration/distributed/test_zero_estimate_against_real.py)."""

from __future__ import annotations

import pytest
import torch

import gradaccum as ga
from gradaccum.planning.estimate.zero import ZeroConfig, from_deepspeed


def test_auto_bucket_is_the_hidden_size_squared_and_precision_follows_the_run():
    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2,
              "reduce_bucket_size": "auto", "overlap_comm": True}}  # fmt: skip
    got = from_deepspeed(config, hidden_size=64, precision="bf16")
    assert got == ZeroConfig(stage=2, precision="bf16", reduce_bucket_size=4096, overlap_comm=True)
    assert from_deepspeed({"zero_optimization": {"stage": 1}}).reduce_bucket_size == 500_000_000
    assert (
        from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}).precision
        == "fp16"
    )


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3 is not modelled"),
        ({}, "ZeRO stage 0 is not modelled"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         "offload_optimizer to cpu"),
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "data_types": {"grad_accum_dtype": "fp32"}}, "grad_accum_dtype fp32"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, "set it to a number"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "'big': expected"),
    ],
)  # fmt: skip
def test_what_is_not_modelled_is_refused_in_one_line(config, said):
    with pytest.raises(ValueError, match=said) as err:
        from_deepspeed(config)
    assert "\n" not in str(err.value)


def test_a_small_model_under_zero_2_holds_what_deepspeed_holds_at_the_step():
    """Eight Linear(32, 32) (8,448 parameters, even: no padding at world 1) in bf16, a bucket of
    10,000 elements, one micro-batch: at the step, the flat bf16 weights (2 B each), the float32
    master and its two moments (12 B), the bf16 gradient partition, its flattened copy and its
    float32 cast (2 + 2 + 4 B) are live together: 22 B a parameter, counted here by hand; the
    backward (the 20,000-byte bucket and its flattened copy beside 16 B a parameter) holds
    less. Without the float32 cast it would be 18 B, without the master 18 B."""
    n = 8 * (32 * 32 + 32)
    est = ga.estimate(
        lambda: torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(8))),
        lambda ps: torch.optim.AdamW(ps, fused=True),
        lambda k: torch.randn(k, 32),
        lambda m, x: (m(x.to(torch.bfloat16)).float().pow(2).sum(), x.shape[0]),
        micro_size=2,
        micro_batches=1,
        device="cpu",
        shard="zero",
        deepspeed=ZeroConfig(stage=2, precision="bf16", reduce_bucket_size=10_000),
    )
    assert 12 * n <= est.parts["optimizer state"] <= 12 * n + 64  # and torch's 0-d step count
    assert 22 * n <= est.allocated <= 22 * n + 1024, (est.allocated, 22 * n)


def test_shard_zero_needs_its_configuration():
    with pytest.raises(ValueError, match="go together"):
        ga.estimate(lambda: torch.nn.Linear(2, 2), torch.optim.SGD, torch.randn(1, 2),
                    lambda m, x: (m(x).sum(), 1), device="cpu", shard="zero")  # fmt: skip
