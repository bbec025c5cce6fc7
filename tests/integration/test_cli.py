"""`gradaccum plan` and `gradaccum check` as a user runs them: real subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

from gradaccum.memory import parse_bytes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_the_planned_micro_batch_fits_its_budget_in_a_fresh_process(tmp_path):
    budget = "220MB"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradaccum",
            "plan",
            "--effective-batch",
            "256",
            "--budget",
            budget,
            "--json",
            "--plot",
            str(tmp_path / "plan.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    planned = json.loads(proc.stdout)
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    assert sum(planned["micro_sizes"]) == 256
    # Resident memory of the same training varies by several percent from one process to
    # the next (glibc's heap layout), so the training is measured twice and both must fit.
    peaks = []
    for _ in range(2):
        run = subprocess.run(
            [
                sys.executable,
                str(HERE / "memory_run.py"),
                "--micro",
                str(planned["micro_size"]),
                "--effective",
                "256",
                "--windows",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        peaks.append(json.loads(run.stdout)["peak"])
    measured = sum(peaks) / len(peaks)
    error = (planned["predicted_peak"] - measured) / measured
    print(
        f"micro {planned['micro_size']}: predicted {planned['predicted_peak'] / 1e6:.1f} MB, "
        f"measured {[round(p / 1e6, 1) for p in peaks]} MB ({error:+.1%}), budget {budget}"
    )
    assert max(peaks) <= parse_bytes(budget)
    assert abs(error) <= 0.15


def test_cli_plan_help_and_bad_budget():
    out = subprocess.run(
        [sys.executable, "-m", "gradaccum", "plan", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    for flag in (
        "--effective-batch",
        "--budget",
        "--recipe",
        "--json",
        "--plot",
        "--checkpointing",
        "--margin",
        "--world-size",
    ):
        assert flag in out
    bad = subprocess.run(
        [sys.executable, "-m", "gradaccum", "plan", "--budget", "lots"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert bad.returncode == 2
    assert "cannot read 'lots' as a memory size" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cli_check_passes_a_groupnorm_recipe():
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", "check", "--recipe", "digits"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PASS: the accumulated gradient (4 micro-batches) equals" in proc.stdout
