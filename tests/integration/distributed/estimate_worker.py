"""A real FSDP2 window's live tensor bytes on each rank, to check the estimate's model of
FSDP2 against (bench/estimate_fsdp.py and
tests/integration/distributed/test_fsdp_estimate_against_real.py):
a GPT-shaped model of tens of MB, each block and the root wrapped by ``fully_shard`` as
torchtitan does, trained two windows through gradaccum's Accumulator, measured by
``support.live_tensors.LiveBytes`` (no code of the estimate)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from support.live_tensors import LiveBytes

import gradaccum as ga

# an odd vocabulary: the embedding's and the head's rows do not split evenly (FSDP2 pads)
VOCAB, WIDTH, LAYERS, LENGTH = 4099, 384, 6, 64


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sample(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH + 1))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor):
    logits = model(batch[:, :-1])
    labels = batch[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels, reduction="sum")
    return loss, labels.numel()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def fused_adamw(params):
    """DeepSpeed's FusedAdam as the estimate models it: in place, its moments at the first step."""
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def fsdp_peak(rank: int, world: int, sync: str, micro_size: int, micro_batches: int, out: str):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    acc = ga.Accumulator(model, adamw(list(model.parameters())), sync=sync)
    meter = LiveBytes(*model.parameters(), *model.buffers())
    with meter:
        for _ in range(2):
            acc.step([sample(micro_size) for _ in range(micro_batches)], loss_fn)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": meter.peak}))
