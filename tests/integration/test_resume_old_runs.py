"""A run folder written by an earlier release resumes under this one (tests/fixtures/run-0.5,
made by gradaccum 0.5.0; its README says how). The run is the same run: the fixture's
recorded losses are what this version computes for those steps, and the steps trained after
the resume are what a straight run of this version trains."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_lines

from gradaccum.app.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-0.5"
ARGS = ["--recipe", "digits", "--effective-batch", "16", "--micro-batch", "6"]
ARGS += ["--checkpoint-every", "3", "--eval-every", "3"]


def losses(run: Path) -> list[float]:
    lines = run_lines(run)
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))
    return [x["loss"] for x in lines]


def test_a_run_folder_of_0_5_resumes_as_the_same_run(tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    assert main(["train", "--resume", str(old), "--steps", "9"]) == 0
    said = capsys.readouterr().out
    assert f"resuming {old} at step 6 of 9" in said, said
    straight = tmp_path / "straight"
    assert main(["train", *ARGS, "--steps", "9", "--out", str(straight)]) == 0

    resumed, fresh = losses(old), losses(straight)
    assert len(resumed) == len(fresh) == 9
    # Losses, not bits: the fixture was computed on another machine, whose kernels may round
    # differently; the same code computes them to within a float's last digits.
    assert resumed == pytest.approx(fresh, rel=1e-5)
    a = torch.load(old / "checkpoint.pt", weights_only=True)
    b = torch.load(straight / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 9
    for name, tensor in b["accumulator"]["model"].items():
        torch.testing.assert_close(a["accumulator"]["model"][name], tensor, rtol=1e-4, atol=1e-6)
