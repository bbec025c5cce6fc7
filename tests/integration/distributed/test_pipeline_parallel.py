"""Exact accumulation through a real pipeline: 2 stages in 2 gloo processes running
torch.distributed.pipelining's GPipe and 1F1B schedules over padded sequences whose
micro-batches hold different token counts. After 3 SGD steps every parameter equals one
process's full-batch run (torch alone: the mean loss over every counted token, backward,
step). The library's default recipe (a mean per micro-batch, gradients divided by their
number) runs beside it on the same data, and its error is measured.

Under bf16 and fp16 autocast the reference is torch alone too: the same 4 micro-batches, each
forward and loss under autocast, backward outside it (fp16: the loss times a power-of-two
pre-scale and the loss scale), one division by the window's token count. An overflow made on
the first stage alone skips the window on both and halves the one loss scale they share."""

from __future__ import annotations

import io
import json
import math

import pytest
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


FP32_CASES = ("gpipe", "1f1b", "1f1b clipped", "torch default")
PRECISION_CASES = ("bf16", "fp16", "fp16 overflow")
OVERFLOW = 1  # the window whose first-stage gradient is made infinite


def worker(rank: int, world: int, out: str, cases: tuple[str, ...]) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    results = {}
    for name in cases:
        model = stages()[rank]
        window_index = [0]
        if name == "fp16 overflow" and rank == 0:
            model.emb.weight.register_hook(
                lambda g, at=window_index: g * math.inf if at[0] == OVERFLOW else g
            )
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if name == "torch default":
            schedule = ScheduleGPipe(stage, MICRO, loss_fn=mean_per_micro_batch)
        elif name in PRECISION_CASES:
            precision = name.split()[0]
            window = PipelineWindow(stage, optimizer, summed, MICRO, precision=precision)
        else:
            clip = CLIP if name.endswith("clipped") else None
            kind = name.split()[0]
            window = PipelineWindow(
                stage, optimizer, summed, MICRO, schedule=kind, max_grad_norm=clip
            )
        counts, norms, skipped, scales = [], [], [], []
        saved = io.BytesIO()
        for ids, labels in batches():
            if name == "torch default":
                schedule.step(ids) if rank == 0 else schedule.step(target=labels)
                optimizer.step()
                optimizer.zero_grad()
            else:
                result = window.step(ids, target=labels)
                counts.append(result.count)
                norms.append(result.grad_norm)
                skipped.append(result.skipped)
                scales.append(window.precision.scale())
                if window_index[0] == OVERFLOW:  # this stage's part of a checkpoint
                    torch.save(window.state_dict(), saved)
            window_index[0] += 1
        results[name] = {
            "params": {k: v.tolist() for k, v in model.state_dict().items()},
            "counts": counts,
            "norms": norms,
            "skipped": skipped,
            "scales": scales,
        }
        if name == "fp16 overflow":  # resumed after the skipped window, on a fresh model
            model = stages()[rank]
            stage = PipelineStage(model, rank, world, torch.device("cpu"))
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            window = PipelineWindow(stage, optimizer, summed, MICRO, precision="fp16")
            saved.seek(0)
            window.load_state_dict(torch.load(saved, weights_only=True))
            for ids, labels in batches()[OVERFLOW + 1 :]:
                window.step(ids, target=labels)
            results["fp16 resumed"] = {
                "params": {k: v.tolist() for k, v in model.state_dict().items()},
                "scale": window.precision.scale(),
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


def autocast_reference(
    precision: str, skip: int | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Torch alone under autocast: per micro-batch, forward and loss under autocast and
    backward outside it; fp16 scales the loss by 2**-floor(log2(first count)) x the loss
    scale (65536, halved after a skipped window). One division per window, one step."""
    first, last = stages()
    params = [*first.parameters(), *last.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scale, scales = 65536.0 if precision == "fp16" else 1.0, []
    for index, (ids, labels) in enumerate(batches()):
        size, prescale = BATCH // MICRO, None
        for i in range(0, BATCH, size):
            with torch.autocast("cpu", dtype=dtype):
                loss_sum, count = summed(last(first(ids[i : i + size])), labels[i : i + size])
            if prescale is None:
                prescale = 2.0 ** -math.floor(math.log2(int(count))) if scale != 1.0 else 1.0
            (loss_sum * prescale * scale).backward()
        if index == skip:
            scale /= 2
        else:
            total = int((labels != -100).sum())
            for p in params:
                p.grad /= total * prescale * scale
            optimizer.step()
        optimizer.zero_grad()
        scales.append(scale)
    return [first.state_dict(), last.state_dict()], scales


def worst_error(params: dict[str, list], want: dict[str, torch.Tensor]) -> float:
    return max(
        float((torch.tensor(v) - want[k]).abs().max() / want[k].abs().max())
        for k, v in params.items()
    )


def test_gpipe_and_1f1b_windows_equal_the_full_batch_where_the_default_does_not(tmp_path):
    launch(worker, str(tmp_path), FP32_CASES, timeout=90)
    plain, clipped = reference(), reference(CLIP)
    assert all(n > CLIP for n in clipped[1])  # clipping acts on every step
    counts = [int((labels != -100).sum()) for _, labels in batches()]
    errors = {}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"stage{rank}.json").read_text())
        for name, result in got.items():
            want, norms = clipped if name.endswith("clipped") else plain
            worst = worst_error(result["params"], want[rank])
            errors[name] = max(errors.get(name, 0.0), worst)
            if name != "torch default":
                assert result["counts"] == counts  # every stage knows the global count
                for mine, theirs in zip(result["norms"], norms, strict=True):
                    assert abs(mine - theirs) < 1e-5 * theirs  # the norm over both stages
    print(f"parameters after {STEPS} steps, worst relative error: {errors}")
    exact = max(errors["gpipe"], errors["1f1b"], errors["1f1b clipped"])
    assert exact < 1e-5
    assert errors["torch default"] > 100 * max(exact, 1e-7)


def test_bf16_and_fp16_through_the_pipeline_equal_torch_under_autocast(tmp_path):
    launch(worker, str(tmp_path), PRECISION_CASES, timeout=90)
    fp32 = reference()[0]
    references = {
        "bf16": autocast_reference("bf16"),
        "fp16": autocast_reference("fp16"),
        "fp16 overflow": autocast_reference("fp16", skip=OVERFLOW),
    }
    errors, from_fp32 = {}, {}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"stage{rank}.json").read_text())
        for name in PRECISION_CASES:
            result, (want, scales) = got[name], references[name]
            errors[name] = max(errors.get(name, 0.0), worst_error(result["params"], want[rank]))
            from_fp32[name] = max(
                from_fp32.get(name, 0.0), worst_error(result["params"], fp32[rank])
            )
            if name.startswith("fp16"):
                assert result["scales"] == scales  # one loss scale on both stages
        # The overflow was on the first stage's gradient only: both stages skipped it.
        skipped = got["fp16 overflow"]["skipped"]
        assert skipped == [None] * OVERFLOW + ["fp16 overflow"] + [None] * (STEPS - OVERFLOW - 1)
        # Each stage's checkpoint after the skip (its scaler's halved scale in it), loaded
        # into fresh stages: the rest of the run is the same to the last bit.
        resumed = got["fp16 resumed"]
        assert resumed["params"] == got["fp16 overflow"]["params"]
        assert resumed["scale"] == got["fp16 overflow"]["scales"][-1] == 32768.0
    print(
        f"after {STEPS} steps, worst relative error against torch under autocast: {errors}; "
        f"against fp32: {from_fp32}"
    )
    for name in PRECISION_CASES:
        assert errors[name] < 1e-5
        # Autocast ran: the low-precision forward is far from fp32's.
        assert from_fp32[name] > 100 * max(errors[name], 1e-7)


def two_terms(logits: torch.Tensor, labels: torch.Tensor):
    """A token term and a per-sequence term (weight 0.5), each its own mean."""
    mask = labels != -100
    token = F.cross_entropy(
        logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
    ).reshape(labels.shape)
    return {"ce": ga.per_token(token, mask), "seq": (*ga.per_sequence(token, mask), 0.5)}


def two_counts(labels: torch.Tensor):
    mask = labels != -100
    return {"ce": ga.token_count(mask), "seq": ga.sequence_count(mask)}


def terms_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage

    model = stages()[rank]
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    window = PipelineWindow(stage, optimizer, two_terms, MICRO, schedule="1f1b")
    means = [window.step(ids, target=labels, counts=two_counts).terms for ids, labels in batches()]
    with open(f"{out}/terms{rank}.json", "w") as f:
        json.dump(
            {"params": {k: v.tolist() for k, v in model.state_dict().items()}, "means": means}, f
        )


def test_named_terms_through_two_stages_equal_the_full_batch(tmp_path):
    """Each term divided by its own count over the window: the last stage counts, the first
    names the terms; 3 SGD steps against torch alone on the whole batch."""
    launch(terms_worker, str(tmp_path), timeout=90)
    first, last = stages()
    params = [*first.parameters(), *last.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    means = []
    for ids, labels in batches():
        logits = last(first(ids))
        mask = labels != -100
        token = F.cross_entropy(
            logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
        ).reshape(labels.shape)
        per_row = (token * mask).sum(1) / mask.sum(1)
        (token[mask].mean() + 0.5 * per_row.mean()).backward()
        means.append(per_row.mean().item())
        optimizer.step()
        optimizer.zero_grad()
    want = [first.state_dict(), last.state_dict()]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"terms{rank}.json").read_text())
        assert worst_error(got["params"], want[rank]) < 1e-5
        assert [m["seq"] for m in got["means"]] == pytest.approx(means, rel=1e-5)
