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
from support.faults import flip_tensor_bit
from support.runs import digits_config, quiet

from gradaccum.app import Trainer, build_run
from gradaccum.app.folder import CHECKPOINT, CONFIG, RunFolder


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
