"""ga.estimate(shard="fsdp") against real FSDP2 windows: 2 processes on gloo over 127.0.0.1,
a GPT-shaped model of tens of MB (estimate_worker.Net), each block and the root wrapped by
fully_shard, two windows of 2 micro-batches through gradaccum's Accumulator, each rank's live
tensor bytes measured by support.live_tensors.LiveBytes (no code of the estimate). Several
runs each: the estimate must be at or above the highest and within 10% of it.

Where the peak falls in backward (micro sync at micro-batch 4 x 2), a buffer that gloo's
thread lets go of after FSDP2 has sometimes lifts a run's peak above FSDP2's own sequence
(bench/results/estimate.md has the spread); the cases here peak in the forward, where every
run measures the same."""

from __future__ import annotations

import json

import estimate_worker as worker
import pytest
from launch import launch

import gradaccum as ga

RUNS = 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "micro_size", "micro_batches"), [("window", 4, 2), ("micro", 8, 3)]
)
def test_fsdp_estimate_bounds_real_fsdp2_windows_within_10_percent(
    sync, micro_size, micro_batches, tmp_path
):
    peaks = []
    for run in range(RUNS):
        out = tmp_path / str(run)
        out.mkdir()
        launch(worker.fsdp_peak, sync, micro_size, micro_batches, str(out), timeout=180)
        peaks.append(max(json.loads((out / f"rank{r}.json").read_text())["peak"] for r in (0, 1)))
    est = ga.estimate(worker.Net, worker.adamw, worker.sample, worker.loss_fn,
                      micro_size=micro_size, micro_batches=micro_batches, device="cpu",
                      world_size=2, shard="fsdp", sync=sync)  # fmt: skip
    assert max(peaks) <= est.allocated <= 1.10 * max(peaks), (est.allocated, peaks)
