"""Under torchrun, what the job says (issue 43, "nothing silent"): one line for the whole
job, the launch a stop needs to continue, a resume on another number of processes said and
recorded, and a process whose peer died saying so with a status of its own. 2 real
processes on gloo over 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch
from helpers import max_rel_err
from launch import torchrun

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# 45 images per step: rank 0 trains 23, rank 1 22; in one process, 45 in 3 micro-batches.
DIGITS = ["train", "--recipe", "digits", "--effective-batch", "45", "--micro-batch", "16"]
LONG = [*DIGITS, "--steps", "400", "--eval-every", "500", "--checkpoint-every", "500"]


def run(cmd: list, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return helpers.run(cmd, cwd, check=check, timeout=120)


def start(cmd: list, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in cmd], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never trained its first steps"
        time.sleep(0.05)


def ours(err: str) -> list[str]:
    """The lines gradaccum said (torchrun's own report aside)."""
    return [x for x in err.splitlines() if x.startswith("gradaccum:")]


def test_a_refusal_under_torchrun_is_one_line_for_the_whole_job(tmp_path):
    proc = run([*torchrun(), "-m", "gradaccum", *DIGITS[:3], "--effective-batch", "1",
                "--steps", "1", "--out", "run"], tmp_path, check=False)  # fmt: skip
    said = ours(proc.stderr)
    assert said == [
        "gradaccum: error: effective_batch 1 cannot be split across 2 processes: each needs "
        "at least one sample"
    ], proc.stderr[-3000:]
    assert "gradaccum/app" not in proc.stderr  # no traceback of ours, from either rank
    assert not (tmp_path / "run").exists()


def test_a_rank_whose_peer_died_says_so_in_one_line_with_a_status_of_its_own(tmp_path):
    proc = start([*torchrun(), "-m", "gradaccum", *LONG, "--out", "run"], tmp_path)
    try:
        wait_for_steps(proc, tmp_path / "run" / "metrics.jsonl", 3)
        workers = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        rank = {_rank_of(int(pid)): int(pid) for pid in workers}
        os.kill(rank[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ours(err) == [
        "gradaccum: error: another process of this job (rank 1) died while rank 0 waited on "
        "it in a collective (RuntimeError), so rank 0 stops too; the launcher's report says "
        "how that process ended"
    ], err[-4000:]
    assert "[rank0]" not in err, err[-4000:]  # no traceback of rank 0's
    # torchrun's report: rank 0 ended with the status of its own (4), not 1
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 4 ", err), err[-3000:]


def _rank_of(pid: int) -> int | None:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


@pytest.mark.slow
def test_a_stop_under_torchrun_says_the_launch_that_continues_it(tmp_path):
    proc = start([*torchrun(), "-m", "gradaccum", *LONG, "--out", "run"], tmp_path)
    wait_for_steps(proc, tmp_path / "run" / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it to both ranks
    _, err = proc.communicate(timeout=90)
    [line] = [x for x in err.splitlines() if "continue with" in x]  # rank 0 alone
    assert line.endswith(
        "continue with: torchrun --nproc-per-node 2 -m gradaccum train --resume run"
    ), line


@pytest.mark.slow
def test_a_ddp_run_resumed_on_one_process_is_said_recorded_and_keeps_its_batch(tmp_path):
    first = [*torchrun(), "-m", "gradaccum", *DIGITS, "--steps", "4", "--eval-every", "500"]
    run([*first, "--out", "a"], tmp_path)
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["processes"] == 2
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    alone = run([sys.executable, "-m", "gradaccum", "train", "--resume", "a", "--steps", "8"],
                tmp_path)  # fmt: skip
    said = [x for x in alone.stdout.splitlines() if "not bit for bit" in x]
    assert len(said) == 1 and "not bit for bit: 2 processes then, 1 now" in said[0], said
    assert json.loads((tmp_path / "a" / "resumes.jsonl").read_text())["processes"] == [2, 1]
    # The same run resumed as it was launched: 2 processes, bit for bit its own continuation.
    run([*torchrun(), "-m", "gradaccum", "train", "--resume", "b", "--steps", "8"], tmp_path)
    one, two = helpers.run_lines(tmp_path / "a"), helpers.run_lines(tmp_path / "b")
    assert [x["count"] for x in one] == [x["count"] for x in two] == [45] * 8
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
    got = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    want = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    print("max relative difference of the weights:", max_rel_err(got, want))
    assert max_rel_err(got, want) <= 1e-5


@pytest.mark.slow
def test_sigterm_while_rank_0_plans_is_one_line_for_the_job_and_no_folder(tmp_path):
    planned = [*DIGITS[:3], "--effective-batch", "64", "--steps", "400", "--out", "run"]
    proc = start([*torchrun(), "-m", "gradaccum", *planned], tmp_path)
    deadline = time.monotonic() + 90
    while not (tmp_path / "run" / "config.json").exists():  # rank 0 plans after writing it
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never began planning"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it to both ranks
    _, err = proc.communicate(timeout=90)
    assert ours(err) == ["gradaccum: stopped by SIGTERM"], err[-4000:]
    assert "gradaccum/app" not in err  # no traceback of ours
    assert not (tmp_path / "run").exists()
