"""The run folder's and the stops' messages (issue 43, "nothing silent"): each says what is
true, names the file, and says what to do. Runs built in-process (tests/support/runs.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.faults import flip_tensor_bit, rewrite_checkpoint
from support.runs import digits_config, quiet

from gradaccum.app import Trainer, build_run
from gradaccum.app.checkpoints import Checkpointer, Checkpoints
from gradaccum.app.folder import CHECKPOINT, CONFIG, RunFolder


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_resume_past_two_damaged_checkpoints_names_each_one(tmp_path):
    run = tmp_path / "run"
    cfg = digits_config(run, steps=6, checkpoint_every=2, keep_checkpoints=4)
    Trainer(build_run(cfg, log=quiet), quiet).fit()
    kept = run / "checkpoints"
    assert sorted(p.name for p in kept.iterdir())[-2:] == ["step-00000004.pt", "step-00000006.pt"]
    flip_tensor_bit(run / CHECKPOINT, record=2, byte=7, bit=5)
    flip_tensor_bit(kept / "step-00000006.pt", record=2, byte=7, bit=5)
    said: list[str] = []
    resumed = build_run(digits_config(run, steps=8, resume=str(run)), log=said.append)
    try:
        assert resumed.progress.start == 4
    finally:
        resumed.folder.release()
    [line] = [x for x in said if "instead" in x]
    assert f"{run / CHECKPOINT} is damaged" in line, line
    assert f"{kept / 'step-00000006.pt'} is damaged" in line, line
    assert line.index(CHECKPOINT) < line.index("step-00000006.pt") < line.index("resuming from")
    assert f"resuming from {kept / 'step-00000004.pt'} instead" in line, line
    assert "\n" not in line
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])["step"] == 4
    torch.load(kept / "step-00000004.pt", weights_only=True)  # untouched


def refusal_without_privileges(attempt: Callable[[], None]) -> str:
    """The ValueError ``attempt`` raises, run as a user that file permissions bind: root
    writes into any folder, so under root it runs in a child process as nobody."""
    if os.geteuid() != 0:
        with pytest.raises(ValueError) as err:
            attempt()
        return str(err.value)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            attempt()
            said = "no refusal"
        except ValueError as err:
            said = str(err)
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            said = f"{type(err).__name__}: {err}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(child, 0)
    return said


@pytest.fixture
def shared_tmp():
    """A folder that another user may enter (pytest's own are its owner's alone)."""
    path = Path(tempfile.mkdtemp(prefix="gradaccum-readonly-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("resume", [False, True])
def test_a_read_only_run_folder_is_said_to_exist_and_be_unwritable(shared_tmp, resume):
    folder = shared_tmp / "run"
    folder.mkdir()
    if resume:
        (folder / CONFIG).write_text('{"effective_batch": 16}')
    folder.chmod(0o555)
    said = refusal_without_privileges(lambda: RunFolder(folder).open(resume=resume, log=quiet))
    where = f"--resume {folder}" if resume else f"run folder {folder}"
    assert said.startswith(f"{where} exists but cannot be written (Permission denied"), said
    assert "cannot create" not in said and "\n" not in said
    assert said.endswith("make it writable" + ("" if resume else ", or choose another --out"))
    assert sorted(p.name for p in folder.iterdir()) == ([CONFIG] if resume else [])


def test_the_resume_command_is_the_launch_it_needs(tmp_path, monkeypatch):
    from gradaccum.app.launch import resume_command
    from gradaccum.app.stops import StopSignals

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert resume_command(tmp_path) == f"gradaccum train --resume {tmp_path}"
    assert resume_command("my runs/a") == "gradaccum train --resume 'my runs/a'"
    # a worker of `torchrun --nproc-per-node 2 -m gradaccum train ...`, as torchrun starts it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("sys.orig_argv", ["python", "-u", "-m", "gradaccum", "train"])
    line = f"torchrun --nproc-per-node 2 -m gradaccum train --resume {tmp_path}"
    assert resume_command(tmp_path) == line
    assert str(StopSignals([15]).interrupted(7, tmp_path)).endswith(f"continue with: {line}")
    # two nodes of 4, the console script run by `torchrun --no-python gradaccum`
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("sys.orig_argv", ["python", "/venv/bin/gradaccum", "train"])
    monkeypatch.setattr("sys.argv", ["/venv/bin/gradaccum", "train"])
    assert resume_command("run") == (
        "torchrun --nnodes 2 --nproc-per-node 4 /venv/bin/gradaccum train --resume run"
    )


def test_a_failed_checkpoint_write_under_torchrun_says_the_launch_it_needs(tmp_path, monkeypatch):
    run = build_run(digits_config(tmp_path / "run"), log=quiet)
    try:
        saver = Checkpointer(
            Checkpoints(run.folder), run.kind, run.acc, run.state_dict, every=3, keep=None,
            start=0,
        )  # fmt: skip
        (run.folder.path / "metrics.jsonl").write_text('{"step": 1}\n')  # it trained
        saver.save(0)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr("sys.orig_argv", ["python", "-u", "-m", "gradaccum", "train"])
        said = saver.stopped("disk full")
        assert "its last checkpoint (step 0) is kept" in said, said
        assert said.endswith(
            f"continue with: torchrun --nproc-per-node 2 -m gradaccum train --resume "
            f"{run.folder.path}"
        ), said
    finally:
        run.folder.release()


def saved_processes(run: Path, processes: int | None) -> None:
    """The checkpoint as a run trained by ``processes`` processes leaves it (None: as
    gradaccum wrote it before the count was recorded); its time stays the session's, so
    the folder still reads as a session that ended at its length."""
    stamp = (run / CHECKPOINT).stat()

    def change(state: dict) -> None:
        state.pop("processes")
        if processes is not None:
            state["processes"] = processes

    rewrite_checkpoint(run / CHECKPOINT, change)
    os.utime(run / CHECKPOINT, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_resume_on_another_process_count_that_keeps_the_batch_is_said_and_recorded(tmp_path):
    run = tmp_path / "run"
    Trainer(build_run(digits_config(run, steps=3), log=quiet), quiet).fit()
    assert torch.load(run / CHECKPOINT, weights_only=True)["processes"] == 1
    saved_processes(run, 2)  # a run of `torchrun --nproc-per-node 2`, resumed alone
    said: list[str] = []
    Trainer(build_run(digits_config(run, steps=6, resume=str(run)), log=said.append), quiet).fit()
    [line] = [x for x in said if "not bit for bit" in x]
    assert "not bit for bit: 2 processes then, 1 now" in line, line
    assert json.loads((run / "resumes.jsonl").read_text()) == {
        "step": 3, "changed": {"steps": [3, 6]}, "after": "its length", "processes": [2, 1],
    }  # fmt: skip
    assert torch.load(run / CHECKPOINT, weights_only=True)["processes"] == 1


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_resume_on_another_process_count_that_would_change_the_batch_is_refused(tmp_path):
    run = tmp_path / "run"
    schedule = {"batch_schedule": "steps:2=32"}
    Trainer(build_run(digits_config(run, steps=3, **schedule), log=quiet), quiet).fit()
    saved_processes(run, 2)
    with pytest.raises(ValueError) as refused:
        build_run(digits_config(run, steps=6, resume=str(run), **schedule), log=quiet)
    said = str(refused.value)
    assert said.startswith(f"--resume {run}: the run trained with 2 processes, this job has 1;")
    assert "--batch-schedule steps:2=32 rounds its batches" in said, said
    assert said.endswith(
        f"Resume it with: torchrun --nproc-per-node 2 -m gradaccum train --resume {run}"
    )
    assert not (run / "resumes.jsonl").exists()  # nothing written


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_run_folder_from_before_the_count_was_recorded_resumes_as_before(tmp_path):
    run = tmp_path / "run"
    Trainer(build_run(digits_config(run, steps=3), log=quiet), quiet).fit()
    saved_processes(run, None)
    said: list[str] = []
    Trainer(build_run(digits_config(run, steps=6, resume=str(run)), log=said.append), quiet).fit()
    assert not [x for x in said if "bit for bit" in x]
    assert json.loads((run / "resumes.jsonl").read_text()) == {
        "step": 3, "changed": {"steps": [3, 6]}, "after": "its length",
    }  # fmt: skip


def test_a_failed_write_after_the_step_0_checkpoint_says_that_one_is_kept(tmp_path):
    run = build_run(digits_config(tmp_path / "run"), log=quiet)
    try:
        saver = Checkpointer(
            Checkpoints(run.folder), run.kind, run.acc, run.state_dict, every=3, keep=2,
            start=0,
        )  # fmt: skip
        saver.save(0)  # the guard's checkpoint of step 0, before training
        (run.folder.path / "metrics.jsonl").write_text('{"step": 1}\n')  # it trained
        (run.folder.path / "checkpoint.pt.tmp").mkdir()  # the next write fails for real
        with pytest.raises(ValueError) as failed:
            saver.save(3)
        said = str(failed.value)
        assert said.startswith(f"cannot write {run.folder.path / CHECKPOINT}"), said
        assert "training stopped, its last checkpoint (step 0) is kept" in said, said
        assert "no checkpoint yet" not in said
        assert said.endswith(f"continue with: gradaccum train --resume {run.folder.path}")
    finally:
        run.folder.release()
