"""Both integrations under torchrun: 2 processes on gloo over 127.0.0.1, each rank's
micro-batches holding different token counts. After 3 SGD steps the parameters match one
process's full-batch run (the mean over every counted token of the 32 sequences a step
covers, one backward)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from frameworks import padded_sequences, stack, tiny_gpt2, token_sum_loss
from helpers import max_rel_err
from test_torchrun import ENV, torchrun

WORKER = Path(__file__).with_name("framework_worker.py")


def full_batch_run() -> dict[str, torch.Tensor]:
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    items = padded_sequences(96)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss, count = token_sum_loss(model, stack(items[32 * step : 32 * (step + 1)]))
        (loss / count).backward()
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_two_ranks_match_one_process_full_batch(tmp_path, framework):
    pytest.importorskip(framework)
    out = tmp_path / "params.pt"
    proc = subprocess.run(
        [*torchrun(), str(WORKER), framework, str(out)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    want = full_batch_run()
    got = {k.removeprefix("module."): v for k, v in got.items()}
    err = max_rel_err(got, want)
    print(f"{framework} under torchrun, 2 ranks: parameters after 3 steps {err:.1e}")
    assert err <= 1e-5


def test_the_accumulator_on_accelerates_ddp_model_matches_the_full_batch(tmp_path):
    """examples/accelerate_ddp.py: the model and optimizer from accelerator.prepare (DDP)."""
    pytest.importorskip("accelerate")
    example = Path(__file__).resolve().parents[3] / "examples" / "accelerate_ddp.py"
    proc = subprocess.run(
        [*torchrun(), str(example)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = [int(c) for c in re.findall(r"over (\d+) tokens", proc.stdout)]
    assert len(counts) == 3, proc.stdout
    diff = float(re.search(r"full batch: (\S+)", proc.stdout).group(1))
    assert diff <= 1e-5, proc.stdout
