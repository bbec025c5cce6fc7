"""A start that fails, for any reason, before its first step leaves nothing that refuses the
same command, fixed: not on the same --out, not on the default one (runs/RECIPE-TIME).

Real subprocesses and signals; input refused before anything runs goes through the CLI's own
``main`` in this process (the same code and exit status, without importing torch again).
"""

import signal
import subprocess
import sys
import time

import pytest
from test_faults import (
    DIGITS,
    ENV,
    ROOT,
    _limit_file_size,
    cli,
    in_process,
    one_line,
    start,
    steps,
)

FIXED = [*DIGITS, "--steps", 1, "--no-guard"]


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--max-grad-norm", "nan", "--max-grad-norm must be a finite number >= 0, got nan"),
        ("--seed", str(2**64), f"seed must be an integer below 2**63, got {2**64}"),
        ("--steps", str(2**63), "steps must be an integer below 2**63"),
        ("--lora-alpha", "inf", "--lora-alpha must be a positive finite number"),
        ("--budget", "1e300GB", "a memory size must be below 2**63 bytes"),
        ("--max-memory", "1e300GB", "a memory size must be below 2**63 bytes"),
        ("--lr", "nan", "lr must be a positive finite number"),
    ],
)
def test_values_no_run_could_use_are_refused_before_anything_is_written(
    tmp_path, flag, value, said
):
    run = tmp_path / "run"
    one_line(in_process("train", *FIXED, "--out", run, flag, value), said)
    assert not run.exists()


@pytest.mark.slow  # make test keeps its 8 minutes
def test_after_refused_values_the_fixed_command_trains_in_the_same_folder(tmp_path):
    run = tmp_path / "run"
    for flag, value in (("--max-grad-norm", "nan"), ("--seed", str(2**64))):
        one_line(in_process("train", *FIXED, "--out", run, flag, value), flag)
    done = in_process("train", *FIXED, "--out", run, "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert steps(run) == [1]


@pytest.mark.slow
def test_a_plan_that_fails_leaves_no_folder_on_the_same_or_the_default_out(tmp_path):
    run = tmp_path / "run"
    too_small = ["--budget", "1KB"]
    failed = cli("train", "--recipe", "digits", "--effective-batch", 16, *too_small, "--out", run)
    one_line(failed, "budget 1000 B is too small")
    assert not run.exists()
    cli("train", *FIXED, "--out", run, check=True)
    assert steps(run) == [1]
    # The default folder, runs/digits-TIME, from a working directory of its own.
    failed = cli("train", "--recipe", "digits", *too_small, cwd=tmp_path)
    one_line(failed, "too small")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    cli("train", *FIXED, cwd=tmp_path, check=True)
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.slow
def test_a_full_disk_at_the_first_write_leaves_nothing_and_says_run_it_again(tmp_path):
    """The guard's step-0 checkpoint (written before training) finds the disk full
    (RLIMIT_FSIZE, as a full disk answers): nothing trained, nothing left behind."""
    run = tmp_path / "run"
    args = ["train", *DIGITS, "--steps", 2, "--out", run]
    full = cli(*args, preexec_fn=_limit_file_size(30_000))
    one_line(full, f"cannot write {run / 'checkpoint.pt'}", "run the same command again")
    assert not run.exists()
    cli(*args, check=True)
    assert steps(run) == [1, 2]


def _planning(run, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the start holds the folder's lock and is planning (no step yet)."""
    deadline = time.monotonic() + timeout
    while not (run / "config.json").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the start never wrote its config.json"
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_or_kill_9_while_planning_leaves_what_the_same_command_reuses(tmp_path):
    planned = ["train", "--recipe", "digits", "--effective-batch", 16, "--steps", 1]
    run = tmp_path / "run"
    proc = start(*planned, "--out", run)
    _planning(run, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "gradaccum: interrupted", err
    assert not run.exists()  # it made the folder: it is gone

    proc = start(*planned, "--out", run)
    _planning(run, proc)
    proc.kill()
    proc.wait()
    assert (run / "config.json").exists()  # what kill -9 leaves: a start that never trained
    again = cli(*planned, "--out", run, check=True)
    assert "holds a start that never trained a step" in again.stdout
    assert steps(run) == [1]


def test_the_loser_of_two_simultaneous_starts_is_told_another_process_trains(tmp_path):
    run = tmp_path / "run"
    first = start("train", *DIGITS, "--steps", 400, "--out", run)
    try:
        deadline = time.monotonic() + 120
        while not (run / ".lock").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.02)
        second = subprocess.run(
            [sys.executable, "-m", "gradaccum", "train", *map(str, DIGITS), "--out", str(run)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=ENV,
            timeout=120,
        )
        one_line(second, f"another process is training in {run}")
    finally:
        first.kill()
        first.wait()
