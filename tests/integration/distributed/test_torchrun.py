"""`torchrun --nproc-per-node 2 -m gradaccum train`: 2 real processes on gloo over 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import helpers
import pytest
import torch
from helpers import max_rel_err
from launch import torchrun

# 45 images per step: rank 0 trains 23 (micro-batches of 16 + 7), rank 1 trains 22 (16 + 6);
# from step 3 on (a batch schedule), 96: 48 each, in 3 micro-batches of 16.
ARGS = [
    "train",
    "--recipe",
    "digits",
    "--steps",
    "6",
    "--effective-batch",
    "45",
    "--micro-batch",
    "16",
    "--eval-every",
    "3",
    "--batch-schedule",
    "steps:3=96",
]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    return helpers.run(cmd, cwd, timeout=60)


@pytest.mark.slow
def test_torchrun_two_processes_train_the_global_batch_into_one_run_folder(tmp_path):
    proc = run([*torchrun(), "-m", "gradaccum", *ARGS, "--out", "two"], tmp_path)
    run([sys.executable, "-m", "gradaccum", *ARGS, "--out", "one"], tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # rank 1 wrote nothing
    two, one = tmp_path / "two", tmp_path / "one"
    for name in ("config.json", "plan.json", "metrics.jsonl", "checkpoint.pt", "summary.json"):
        assert (two / name).is_file(), name
    lines = helpers.run_lines(two)
    assert [x["step"] for x in lines] == list(range(1, 7))  # once, by rank 0
    # the global batch, counted over both ranks
    assert [x["count"] for x in lines] == [45, 45, 45, 96, 96, 96]
    assert "on each of 2 processes" in proc.stdout

    # The same run in one process: same losses and parameters within fp32 rounding. Tight on
    # purpose: AdamW turns a rounding-order change on a near-zero gradient element into a
    # full-size update (a pre-division by an expected total that the counts then missed moved
    # these parameters 2.6e-3 apart), so this also holds both paths to the same arithmetic.
    single = helpers.run_lines(one)
    for a, b in zip(lines, single, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
    got = torch.load(two / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    want = torch.load(one / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    assert max_rel_err(got, want) <= 1e-5


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_at_one_checkpointed_window(tmp_path):
    args = [
        "train",
        "--recipe",
        "digits",
        "--steps",
        "200",
        "--effective-batch",
        "64",
        "--micro-batch",
        "16",
        "--eval-every",
        "500",
        "--checkpoint-every",
        "500",
    ]
    proc = subprocess.Popen(
        [*torchrun(), "-m", "gradaccum", *args, "--out", "run"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 45
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 6
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it to both ranks
    _, err = proc.communicate(timeout=45)
    assert proc.returncode != 0
    assert err.count("stopped by SIGTERM at step") == 1, err[-3000:]  # rank 0 says it, once
    at = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"]
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert logged == list(range(1, at + 1)), (at, logged[-3:])  # every logged step is saved
    assert 6 <= at < 200

    # The resumed run trains the rest: minutes, not seconds, on a loaded 2-core machine.
    helpers.run([*torchrun(), "-m", "gradaccum", "train", "--resume", "run"], tmp_path, timeout=240)
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert logged == list(range(1, 201))


def _rank_pid(parent: int, rank: str) -> int | None:
    """The pid of the job's process whose RANK is ``rank``, among ``parent``'s descendants."""
    import os

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if env.get(b"RANK") == rank.encode() and b"gradaccum" in cmd and int(entry) != parent:
            return int(entry)
    return None


@pytest.mark.slow  # a torchrun job trained until it is stopped: the slow tier
def test_sigterm_to_one_rank_says_the_continue_line_once_for_the_job(tmp_path):
    """A SIGTERM to rank 1 alone stopped the job at a checkpoint that resumes bit for bit,
    but rank 1 exited first, torchrun stopped rank 0 before it spoke, and no 'continue with'
    line was said (issue 58)."""
    args = ["train", "--recipe", "digits", "--steps", "200", "--effective-batch", "64",
            "--micro-batch", "16", "--eval-every", "500", "--checkpoint-every", "500"]  # fmt: skip
    proc = subprocess.Popen(
        [*torchrun(), "-m", "gradaccum", *args, "--out", "run"],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 4
    ):
        time.sleep(0.05)
    rank1 = _rank_pid(proc.pid, "1")
    assert rank1 is not None, "rank 1 not found"
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert err.count("checkpoint saved; continue with:") == 1, err[-3000:]
    assert "stopped by SIGTERM at step" in err
