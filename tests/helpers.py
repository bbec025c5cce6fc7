"""Small models, data and independent references shared by the tests.

The references here never call gradaccum: a full batch, a mean loss from torch itself,
backward, step. That is what every accumulated result is compared against.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradaccum as ga
from gradaccum.planning import Fit, Plan

# Uneven micro-batch sizes for a batch of 13, one list per N.
UNEVEN_SIZES = {1: [13], 2: [9, 4], 4: [1, 5, 3, 4], 7: [2, 1, 3, 1, 2, 3, 1]}
BATCH = 13
VOCAB = 32
SEQ = 20
PAD = 0


class MLP(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class GroupNormCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.GroupNorm(4, 8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2),
            nn.GroupNorm(4, 8),
            nn.ReLU(),
        )
        self.head = nn.Linear(8 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift
        # shared by a row's scores), so its computed gradient is pure rounding noise, which
        # Adam scales up to full-size updates in any two computations, exact or not.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """A causal transformer LM small enough for exact tests in seconds."""

    def __init__(
        self,
        vocab: int = VOCAB,
        d: int = 16,
        heads: int = 2,
        layers: int = 2,
        max_len: int = SEQ,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def regression_batch(seed: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, torch.randn(n, 3, generator=g)


def image_batch(seed: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def padded_lm_batch(seed: int, n: int = BATCH) -> dict[str, torch.Tensor]:
    """Sequences of very different lengths, right-padded, padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    ids[pad] = PAD
    labels = ids.clone()
    labels[pad] = -100
    return {"input_ids": ids, "labels": labels}


def trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop columns that are padding in every row (dynamic padding per micro-batch)."""
    longest = int((batch["labels"] != -100).sum(1).max())
    return {k: v[:, : max(longest, 2)] for k, v in batch.items()}


# -- the three tasks: (model factory, batch maker, gradaccum loss_fn, reference mean loss) --


def mlp_loss(model, mb):
    x, y = mb
    return ga.sample_mean(F.mse_loss(model(x), y, reduction="none"))


def mlp_reference(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def cnn_loss(model, mb):
    x, y = mb
    return ga.sample_mean(F.cross_entropy(model(x), y, reduction="none"))


def cnn_reference(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_loss(model, mb):
    mb = trim(mb)
    return ga.causal_lm_loss(model(mb["input_ids"]), mb["labels"])


def lm_reference(model, batch):
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


TASKS = {
    "mlp": (MLP, regression_batch, mlp_loss, mlp_reference),
    "cnn": (GroupNormCNN, image_batch, cnn_loss, cnn_reference),
    "lm": (TinyLM, padded_lm_batch, lm_loss, lm_reference),
}


def make_model(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def split_sizes(batch, sizes: list[int]) -> list:
    """Uneven micro-batches, independent of ga.split."""
    out, start = [], 0
    for size in sizes:
        if isinstance(batch, dict):
            out.append({k: v[start : start + size] for k, v in batch.items()})
        else:
            out.append(tuple(t[start : start + size] for t in batch))
        start += size
    return out


def reference_grads(model, batch, reference) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    reference(model, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def capture_step_grads(optimizer, model) -> list[dict[str, torch.Tensor]]:
    """Record the gradients the optimizer is handed at each step (a real optimizer hook)."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []

    def hook(opt, args, kwargs):
        seen.append(
            {
                names[id(p)]: p.grad.clone()
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        )

    optimizer.register_step_pre_hook(hook)
    return seen


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = torch.linalg.vector_norm(b.double())
    diff = torch.linalg.vector_norm(a.double() - b.double())
    if denom == 0:
        return float(diff)
    return float(diff / denom)


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) for k in b)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def deep_lm_setup(dropout=0.0, seq=64, layers=3, d=32):
    model = make_model(lambda: TinyLM(d=d, layers=layers, max_len=seq, dropout=dropout))
    # TinyLM's 32-token vocabulary keeps the logits small, so blocks dominate activations
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32, (16, seq), generator=g)

    def loss_fn(model, mb):
        return ga.causal_lm_loss(model(mb["input_ids"]), mb["labels"])

    return model, {"input_ids": ids, "labels": ids.clone()}, loss_fn


# -- the command line, as a user runs it (integration tests) ----------------------------------

ROOT = Path(__file__).resolve().parent.parent


def run(
    cmd: list, cwd: Path = ROOT, *, check=True, timeout=300, threads=1, **kw
) -> subprocess.CompletedProcess:
    """``cmd`` in a subprocess with its thread count set (OMP_NUM_THREADS); with ``check`` it
    must succeed, its output's tail the failure message. A run past ``timeout`` fails: a hang
    is a failure, not a stuck suite."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        timeout=timeout,
        **kw,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def cli(*args, check=True, timeout=300, threads=2, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    """``gradaccum ARGS`` in a subprocess, from the repository root unless ``cwd``."""
    cmd = [sys.executable, "-m", "gradaccum", *args]
    return run(cmd, cwd, check=check, timeout=timeout, threads=threads, **kw)


def make_plan(effective, world=1, micro=8, precision="fp32", checkpointing=False) -> Plan:
    """A plan with made-up measurements, its window laid out as plan() lays it out:
    micro-batches of ``micro``, the last one smaller."""
    per_rank = effective // world
    n = math.ceil(per_rank / micro)
    line = Fit(intercept=1e6, slope=1e4, max_error=0.0)
    return Plan(
        effective_batch=effective,
        world_size=world,
        per_rank_batch=per_rank,
        micro_size=micro,
        micro_batches=n,
        last_micro_size=per_rank - (n - 1) * micro,
        budget=2**30,
        margin=0.15,
        predicted_peak=1e6 + 1e4 * micro,
        static_bytes=0,
        overhead_bytes=0,
        bytes_per_sample=1e4,
        peak_fit=line,
        activation_fit=line,
        probes=(),
        checkpointing=checkpointing,
        checkpointed_blocks=("blocks.0", "blocks.1") if checkpointing else (),
        device="cpu",
        seconds=0.0,
        largest_fitting=micro,
        precision=precision,
    )


def run_lines(folder: Path, name: str = "metrics.jsonl") -> list[dict]:
    """A run folder's JSON-lines file (metrics.jsonl: one dict per optimizer step)."""
    import json

    return [json.loads(x) for x in (Path(folder) / name).read_text().splitlines()]


def sigterm_then_resume_matches(
    tmp_path: Path, args: list, stop_after: int, steps: int | None, straight: Path | None = None
) -> int:
    """Train ``gradaccum train ARGS`` straight through (or take ``straight``, a run of the same
    ARGS), and again stopped by SIGTERM once ``stop_after`` steps are recorded, then resumed:
    the final weights must be bitwise equal and every step's loss the same. ``steps``: the
    run's length, or None for the straight run's (a run measured in samples). Returns the
    step the stopped run checkpointed at."""
    import signal
    import time

    stopped = tmp_path / "stopped"
    if straight is None:
        straight = tmp_path / "straight"
        cli("train", *args, "--out", straight)
    steps = steps or len(run_lines(straight))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradaccum", "train", *map(str, args), "--out", str(stopped)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if (stopped / "metrics.jsonl").exists() and len(run_lines(stopped)) >= stop_after:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM at step" in err and "--resume" in err
    at = torch.load(stopped / "checkpoint.pt", weights_only=True)["step"]
    assert stop_after <= at < steps, at

    cli("train", "--resume", stopped)
    a = torch.load(straight / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    b = torch.load(stopped / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from the straight one"
    assert [x["step"] for x in run_lines(stopped)] == list(range(1, steps + 1))
    assert [x["loss"] for x in run_lines(stopped)] == [x["loss"] for x in run_lines(straight)]
    return at


def bitwise_equal(a, b) -> bool:
    """Two saved states hold the same keys, the same values and bitwise-equal tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
