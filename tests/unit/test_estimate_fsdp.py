"""ga.estimate(shard="fsdp"): FSDP2 over a world size, modelled from the unsharded trace. What
can be worked out by hand is checked here (FSDP2's padded shards, against torch.chunk as
FSDP2 cuts them; the optimizer state of rank 0's shards; what is refused); the whole window
against real FSDP2 runs in tests/integration/distributed/test_fsdp_estimate_against_real.py."""

from __future__ import annotations

import pytest
import torch
from support.live_tensors import adamw

import gradaccum as ga
from gradaccum.planning.estimate import fsdp


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 3 * d)
        self.down = torch.nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    """Odd sizes: 5 rows of the input layer, 7 of the head, 21 of each block's first layer do
    not split evenly over 2 or 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 7)
        self.blocks = torch.nn.ModuleList(Block(7) for _ in range(3))
        self.head = torch.nn.Linear(7, 5)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sample(n):
    return torch.randn(n, 3), torch.randint(0, 5, (n,))


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), y.numel()


def rank0(shape, world):
    """FSDP2's shard on rank 0, padded: its first chunk (FSDPParam._init_sharded_param)."""
    return torch.chunk(torch.empty(shape), world, dim=0)[0].numel()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_shards_are_fsdp2s_first_chunk(world):
    for shape in [(21, 7), (7,), (5, 7), (4099, 384), (1, 3), (3,)]:
        assert fsdp.shard_numel(shape, world) == rank0(shape, world), shape


def test_units_are_the_blocks_and_the_root_with_padded_sizes():
    model = Net()
    units = fsdp.layout(model, 4)
    assert units.modules == (model, *model.blocks)
    root = [model.inp.weight, model.inp.bias, model.head.weight, model.head.bias]
    assert units.params[0] == tuple(root)
    assert units.gathered[0] == sum(4 * rank0(p.shape, 4) * 4 for p in root)
    assert (
        units.gathered[1]
        == units.reduced[1]
        == 4 * 4 * sum(rank0(p.shape, 4) for p in model.blocks[0].parameters())
    )


def test_optimizer_state_and_parameters_are_rank_zeros_shards():
    est = ga.estimate(Net, adamw, sample, loss, micro_size=4, micro_batches=2, device="cpu",
                      world_size=4, shard="fsdp")  # fmt: skip
    params = list(Net().parameters())
    # AdamW: two moments of each parameter's shard, and a float32 step count each
    moments = sum(2 * rank0(p.shape, 4) * 4 for p in params)
    assert est.parts["optimizer state"] == moments + 4 * len(params)
    shards = sum(rank0(p.shape, 4) * 4 for p in params)
    # the peak holds the shards and at least one unit's gathered parameters besides
    assert est.parts["parameters"] > shards
    whole = ga.estimate(Net, adamw, sample, loss, micro_size=4, micro_batches=2, device="cpu")
    assert whole.parts["optimizer state"] == sum(2 * p.numel() * 4 for p in params) + 4 * len(
        params
    )
    assert "FSDP2 (fully_shard) on 3 repeated blocks and the root" in " ".join(est.assumptions)


def wide():
    return torch.nn.Sequential(torch.nn.Linear(64, 4096))


def wide_loss(model, x):
    big = torch.ones(4 * 2**20)  # a forward-only temporary: the window peaks in a forward
    return model(x).square().sum() + big.sum() * 0, x.shape[0]


def test_window_sync_holds_the_unsharded_gradient_micro_sync_its_shard():
    def run(sync, **kw):
        return ga.estimate(wide, adamw, lambda n: torch.randn(n, 64), wide_loss, micro_size=2,
                           micro_batches=3, world_size=2, shard="fsdp", sync=sync,
                           **kw)  # fmt: skip

    window, micro = run("window", device="cpu"), run("micro", device="cpu")
    grad = (64 * 4096 + 4096) * 4
    # in the later micro-batches' forward: the whole gradient against rank 0's half of it
    assert window.parts["gradients"] == grad and micro.parts["gradients"] == grad // 2
    assert window.allocated - micro.allocated == grad // 2
    on_gpu = run("micro", gpu="a100-80gb")
    assert on_gpu.reserved >= on_gpu.allocated >= micro.allocated
    assert "'micro': a reduce-scatter per micro-batch" in " ".join(on_gpu.assumptions)


def test_a_loss_that_never_calls_the_models_forward_is_refused():
    def beside(model, x):  # FSDP2 gathers the root's parameters in its forward only
        return model[0](x).sum(), x.shape[0]

    with pytest.raises(ValueError, match="never called the model's forward"):
        ga.estimate(wide, adamw, lambda n: torch.randn(n, 64), beside, micro_size=2,
                    device="cpu", world_size=2, shard="fsdp")  # fmt: skip


def test_activation_checkpointing_under_fsdp_estimates_less():
    plain = ga.estimate(Net, adamw, sample, loss, micro_size=64, micro_batches=2, device="cpu",
                        world_size=2, shard="fsdp")  # fmt: skip
    ckpt = ga.estimate(Net, adamw, sample, loss, micro_size=64, micro_batches=2, device="cpu",
                       world_size=2, shard="fsdp", checkpointing=True)  # fmt: skip
    assert ckpt.parts["activations"] < plain.parts["activations"]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"world_size": 1}, "shard='fsdp' needs world_size of 2 or more, got 1"),
        ({"world_size": 2, "precision": "fp16"}, "precision='fp16' is not modelled"),
        ({"world_size": 2, "evaluate": True}, "evaluate=True is not modelled"),
        ({"world_size": 2, "sync": "each"}, "sync must be 'window' or 'micro', got 'each'"),
    ],
)
def test_what_is_not_modelled_is_refused_in_one_line(kw, words):
    with pytest.raises(ValueError) as err:
        ga.estimate(Net, adamw, sample, loss, micro_size=2, device="cpu", shard="fsdp", **kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_low_precision_parameters_are_refused_in_one_line():
    def half():
        return Net().to(torch.bfloat16)

    with pytest.raises(ValueError, match="torch.bfloat16 trainable parameters is not modelled"):
        ga.estimate(half, adamw, sample, loss, micro_size=2, device="cpu", world_size=2,
                    shard="fsdp")  # fmt: skip
    with pytest.raises(ValueError, match="shard must be 'ddp', 'fsdp' or 'zero', got 'zero3'"):
        ga.estimate(Net, adamw, sample, loss, micro_size=2, world_size=2, shard="zero3")
