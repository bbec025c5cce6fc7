"""Exact accumulation through a real pipeline: 2 stages in 2 gloo processes running
torch.distributed.pipelining's GPipe and 1F1B schedules over padded sequences whose
micro-batches hold different token counts. After 3 SGD steps every parameter equals one
process's full-batch run (torch alone: the mean loss over every counted token, backward,
step). The library's default recipe (a mean per micro-batch, gradients divided by their
number) runs beside it on the same data, and its error is measured."""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from launch import launch

import gradaccum as ga
from gradaccum.pipeline import PipelineWindow

V, T, D, BATCH, MICRO, STEPS, LR, CLIP = 17, 10, 16, 8, 4, 3, 0.5, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.ln(x))


class First(nn.Module):  # embeddings and the first block
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))


class Last(nn.Module):  # the second block, the head and the loss
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(D, V)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(h))


def stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return First(), Last()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Padded next-token batches: each micro-batch of 2 sequences counts different tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, V, (BATCH, T), generator=g)
        labels = ids.roll(-1, 1).clone()
        lengths = torch.randint(1, T + 1, (BATCH,), generator=g)
        lengths[:2] = T  # a full micro-batch beside short ones
        for i, n in enumerate(lengths.tolist()):
            labels[i, n:] = -100
        out.append((ids, labels))
    return out


def summed(logits: torch.Tensor, labels: torch.Tensor):
    return ga.token_cross_entropy(logits, labels)  # (loss_sum, count): counted tokens only


def mean_per_micro_batch(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    results = {}
    for name in ("gpipe", "1f1b", "1f1b clipped", "torch default"):
        model = stages()[rank]
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if name == "torch default":
            schedule = ScheduleGPipe(stage, MICRO, loss_fn=mean_per_micro_batch)
        else:
            clip = CLIP if name.endswith("clipped") else None
            kind = name.split()[0]
            window = PipelineWindow(
                stage, optimizer, summed, MICRO, schedule=kind, max_grad_norm=clip
            )
        counts, norms = [], []
        for ids, labels in batches():
            if name == "torch default":
                schedule.step(ids) if rank == 0 else schedule.step(target=labels)
                optimizer.step()
                optimizer.zero_grad()
            else:
                result = window.step(ids, target=labels)
                counts.append(result.count)
                norms.append(result.grad_norm)
        results[name] = {
            "params": {k: v.tolist() for k, v in model.state_dict().items()},
            "counts": counts,
            "norms": norms,
        }
    with open(f"{out}/stage{rank}.json", "w") as f:
        json.dump(results, f)


def reference(clip: float | None = None) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    first, last = stages()
    params = [*first.parameters(), *last.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    norms = []
    for ids, labels in batches():
        logits = last(first(ids))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip or float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
    return [first.state_dict(), last.state_dict()], norms


def test_gpipe_and_1f1b_windows_equal_the_full_batch_where_the_default_does_not(tmp_path):
    launch(worker, str(tmp_path), timeout=90)
    plain, clipped = reference(), reference(CLIP)
    assert all(n > CLIP for n in clipped[1])  # clipping acts on every step
    counts = [int((labels != -100).sum()) for _, labels in batches()]
    errors = {}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"stage{rank}.json").read_text())
        for name, result in got.items():
            want, norms = clipped if name.endswith("clipped") else plain
            worst = max(
                float((torch.tensor(v) - want[rank][k]).abs().max() / want[rank][k].abs().max())
                for k, v in result["params"].items()
            )
            errors[name] = max(errors.get(name, 0.0), worst)
            if name != "torch default":
                assert result["counts"] == counts  # every stage knows the global count
                for mine, theirs in zip(result["norms"], norms, strict=True):
                    assert abs(mine - theirs) < 1e-5 * theirs  # the norm over both stages
    print(f"parameters after {STEPS} steps, worst relative error: {errors}")
    exact = max(errors["gpipe"], errors["1f1b"], errors["1f1b clipped"])
    assert exact < 1e-5
    assert errors["torch default"] > 100 * max(exact, 1e-7)
