"""The estimate's optimizers whose state is known without running them on CUDA: transformers'
Adafactor (traced as it runs; its state checked against the real optimizer's on the CPU) and
bitsandbytes' blockwise 8-bit optimizers (not installed here, their step a CUDA kernel: the
model's state checked against the layout bitsandbytes documents in optimizer.py's
init_state, worked out below by hand)."""

from __future__ import annotations

import pytest
import torch
from support.live_tensors import measured

import gradaccum as ga
from gradaccum.planning.estimate import allocator
from gradaccum.planning.estimate.optimizers import Blockwise8bit


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def sample(n):
    return torch.randn(n, 512), torch.randint(0, 8, (n,))


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), y.numel()


def adafactor(beta1):
    def make(params):
        return pytest.importorskip("transformers.optimization").Adafactor(
            params, lr=1e-3, scale_parameter=False, relative_step=False, beta1=beta1
        )

    return make


@pytest.mark.slow  # importing transformers.optimization (its Trainer utilities) takes seconds
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_adafactor_state_and_peak_match_the_real_optimizer_on_cpu(beta1):
    est = ga.estimate(
        mlp, adafactor(beta1), sample, loss, micro_size=4, micro_batches=2, device="cpu"
    )
    # the real optimizer after a real step: every tensor in its state, by its own storage
    torch.manual_seed(0)
    model = mlp()
    opt = adafactor(beta1)(list(model.parameters()))
    ga.Accumulator(model, opt).step([sample(4)], loss)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    real = sum(v.untyped_storage().nbytes() for v in state)
    assert est.parts["optimizer state"] == real
    # factored: a row and a column per matrix, far less than the matrix (no first moment)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert (real < weights / 10) == (beta1 is None)
    peak = measured(mlp, sample, loss, 4, 2, optimizer=adafactor(beta1))
    assert abs(est.allocated - peak) <= 0.02 * peak, (est.allocated, peak)


def documented_8bit(states, shapes, min_8bit_size=4096):
    """bitsandbytes' init_state, per parameter: uint8 states and a float32 absmax per block of
    256 values from min_8bit_size values on, float32 states below; one 256-entry float32 map
    per state kind, shared."""
    total, quantized = 0, False
    for numel in shapes:
        if numel < min_8bit_size:
            total += states * numel * 4
        else:
            quantized = True
            total += states * (numel + 4 * ((numel + 255) // 256))
    return total + (states * 256 * 4 if quantized else 0)


SHAPES = (512 * 256, 256, 256 * 8, 8)  # a 8-bit state, a float32 one (under 4,096 values)


@pytest.mark.parametrize("states", [2, 1])
def test_8bit_state_is_the_documented_layout(states):
    est = ga.estimate(
        mlp,
        lambda p: Blockwise8bit(p, states=states),
        sample,
        loss,
        micro_size=4,
        micro_batches=2,
        device="cpu",
    )
    assert est.parts["optimizer state"] == documented_8bit(states, SHAPES)
    # on CUDA each state tensor is its own allocator block
    cuda = ga.estimate(
        mlp, lambda p: Blockwise8bit(p, states=states), sample, loss, micro_size=4, gpu="t4"
    )
    blocks = 2 if states == 2 else 1
    rounded = sum(
        states * allocator.round_size(n * 4)
        if n < 4096
        else states * (allocator.round_size(n) + allocator.round_size(4 * ((n + 255) // 256)))
        for n in SHAPES
    )
    assert cuda.parts["optimizer state"] == rounded + blocks * allocator.round_size(1024)
    assert cuda.unified == 0 and cuda.total == cuda.reserved + cuda.context


def test_paged_8bit_state_is_outside_the_allocator_and_in_the_total():
    paged = ga.estimate(
        mlp, lambda p: Blockwise8bit(p, paged=True), sample, loss, micro_size=4, gpu="t4"
    )
    plain = ga.estimate(mlp, lambda p: Blockwise8bit(p), sample, loss, micro_size=4, gpu="t4")
    # only the 256 x 512 weight has 100,000 values or more: its two uint8 states are paged
    assert paged.unified == 2 * 512 * 256
    assert paged.parts["optimizer state"] == plain.parts["optimizer state"] - 2 * 512 * 256
    assert paged.total == paged.reserved + paged.context + paged.unified
    assert "unified memory" in paged.summary()


def test_a_bitsandbytes_optimizer_is_refused_in_one_line():
    # bitsandbytes is not installed here; a class from its module path stands for one
    cls = type("AdamW8bit", (torch.optim.SGD,), {"__module__": "bitsandbytes.optim.adamw"})
    with pytest.raises(ValueError, match="Blockwise8bit") as err:
        ga.estimate(mlp, lambda p: cls(p, lr=0.1), sample, loss, micro_size=2, device="cpu")
    assert "AdamW8bit" in str(err.value) and "\n" not in str(err.value)
