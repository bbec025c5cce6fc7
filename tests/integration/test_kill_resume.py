"""kill -9 at random moments, resume each time, and end where an uninterrupted run ends.

One 60-step digits run (--checkpoint-every 5) is killed with SIGKILL at random points (a
random step, then a random few milliseconds into the next one: the kill may land in a
forward, an optimizer step, a metrics line or a checkpoint being written) and resumed with
--resume after each kill, until it finishes. Against the same run done in one go: the final
parameters are bitwise equal, every step's loss is bitwise equal, and metrics.jsonl holds
each step exactly once. `make test` runs 3 kill points; the 20-point run is marked slow:
`.venv/bin/python -m pytest -m slow tests/integration/test_kill_resume.py`.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 60
RUN = [
    "--recipe",
    "digits",
    "--effective-batch",
    "16",
    "--micro-batch",
    "8",
    "--steps",
    str(STEPS),
    "--checkpoint-every",
    "5",
    "--eval-every",
    "20",
]


def gradaccum(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gradaccum", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
    )


def lines(run: Path) -> list[dict]:
    file = run / "metrics.jsonl"
    if not file.exists():
        return []
    out = []
    for raw in file.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def final_model(run: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["step"] == STEPS
    return saved["accumulator"]["model"]


def kill_and_resume(tmp_path: Path, points: int, seed: int) -> None:
    reference = tmp_path / "reference"
    proc = gradaccum("train", *RUN, "--out", str(reference))
    assert proc.wait(timeout=300) == 0, proc.stderr.read()

    rng = random.Random(seed)
    targets = sorted(rng.sample(range(1, STEPS), points))
    run = tmp_path / "killed"
    proc = gradaccum("train", *RUN, "--out", str(run))
    kills = 0
    for target in targets:
        while proc.poll() is None and len(lines(run)) < target:
            time.sleep(0.005)
        if proc.poll() is not None:  # the run got past this point before we looked
            break
        time.sleep(rng.uniform(0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        proc = gradaccum("train", "--resume", str(run))
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert kills >= points // 2, f"only {kills} of {points} kill points landed"

    got, expected = lines(run), lines(reference)
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))  # each step exactly once
    assert [x["loss"] for x in got] == [x["loss"] for x in expected]  # bitwise, step by step
    a, b = final_model(run), final_model(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"{kills} kills at steps {targets[:kills]}: final parameters bitwise equal")


@pytest.mark.slow
def test_three_kills_then_resume_end_bitwise_equal(tmp_path):
    kill_and_resume(tmp_path, points=3, seed=0)


@pytest.mark.slow
def test_twenty_kills_then_resume_end_bitwise_equal(tmp_path):
    kill_and_resume(tmp_path, points=20, seed=1)
