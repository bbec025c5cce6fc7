"""A run folder written by an earlier release resumes under this one (tests/fixtures/run-0.5
and run-0.7, made by gradaccum 0.5.0 and 0.7.0; their READMEs say how). The run is the same
run: the fixture's recorded losses are what this version computes for those steps, and the
steps trained after the resume are what a straight run of this version trains."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_lines

from gradaccum.app.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ARGS = ["--recipe", "digits", "--effective-batch", "16", "--micro-batch", "6"]
ARGS += ["--checkpoint-every", "3", "--eval-every", "3"]


def losses(run: Path) -> list[float]:
    lines = run_lines(run)
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))
    return [x["loss"] for x in lines]


@pytest.mark.parametrize("release", ["0.5", "0.7"])
def test_a_run_folder_of_an_earlier_release_resumes_as_the_same_run(release, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / f"run-{release}", old)
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


def test_a_0_7_run_folder_falls_back_on_its_kept_checkpoint(tmp_path, capsys):
    """0.7's guard kept checkpoints/step-N.pt: with checkpoint.pt gone, the resume reads the
    newest kept one (step 6) and trains on as the same run."""
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / "run-0.7", old)
    (old / "checkpoint.pt").unlink()
    assert main(["train", "--resume", str(old), "--steps", "8"]) == 0
    said = capsys.readouterr().out
    assert "checkpoint.pt is missing; resuming from" in said and "(step 6)" in said, said
    straight = tmp_path / "straight"
    assert main(["train", *ARGS, "--steps", "8", "--out", str(straight)]) == 0
    assert losses(old) == pytest.approx(losses(straight), rel=1e-5)
