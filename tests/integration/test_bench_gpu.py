"""bench/gpu.py, the CUDA checks, on a machine without CUDA: it says so and exits 0, and its
checks that run on any device run here (exactness, seconds per step, the plan-against-run
flow). What only CUDA can reach: the real out-of-memory error (set_per_process_memory_fraction)
and the allocator's peaks (max_memory_allocated, max_memory_reserved)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
import torch
from helpers import ROOT, run

SCRIPT = ROOT / "bench" / "gpu.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script measures")
def test_without_cuda_it_says_so_and_exits_0():
    proc = run([sys.executable, SCRIPT])
    assert "no CUDA device here" in proc.stdout, proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1 and not proc.stderr.strip()


def test_its_exactness_check_measures_the_window_against_float64_on_the_cpu():
    gpu = load()
    rows = {x["precision"]: x for x in gpu.exactness(torch.device("cpu"), n=64, micro=16)}
    assert set(rows) == {"fp32", "bf16", "fp16"} and rows["fp32"]["micro_batches"] == 4
    assert rows["fp32"]["window_error"] < 1e-5  # exact, up to fp32 rounding
    for low in ("bf16", "fp16"):
        # autocast rounds; the window rounds no worse than the full batch does, by far
        assert 0 < rows[low]["window_error"] < 3 * rows[low]["full_batch_error"], rows[low]


def test_its_timing_and_report_run_on_the_cpu():
    gpu = load()
    rows = gpu.seconds_per_step(torch.device("cpu"), n=64, repeats=1)
    assert [x["micro_batches"] for x in rows] == [1, 2, 4, 8, 16]
    assert all(x["seconds"] > 0 and x["micro_size"] * x["micro_batches"] == 64 for x in rows)
    results = {
        "device": "cpu",
        "torch": torch.__version__,
        "seconds": 1.0,
        "exactness": gpu.exactness(torch.device("cpu"), n=32, micro=16),
        "oom": {"failed": "needs CUDA"},
        "per_step": rows,
        "plans": [{"case": "gpt, 512MB", "skipped": "the script's 10 minutes"}],
    }
    text = gpu.report(json.loads(json.dumps(results)))
    assert "failed: needs CUDA" in text and "| 16 | 4 |" in text
    assert "| gpt, 512MB | the script's 10 minutes |" in text


@pytest.mark.slow
def test_its_plan_against_run_flow_runs_on_the_cpu(tmp_path):
    gpu = load()
    only = [("digits, 300MB", {"recipe": "digits", "budget": "300MB"})]
    (row,) = gpu.plans_vs_runs(torch.device("cpu"), tmp_path, time.perf_counter(), only=only)
    assert row["steps"] == 20 and row["training_peak"] > 0 and row["predicted"] > 0, row
    assert row["budget"] == 300_000_000 and "allocated" not in row  # CUDA's statistics only
