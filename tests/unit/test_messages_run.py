"""The run folder's and the stops' messages (issue 43, "nothing silent"): each says what is
true, names the file, and says what to do. Runs built in-process (tests/support/runs.py)."""

from __future__ import annotations

import json

import torch
from support.faults import flip_tensor_bit
from support.runs import digits_config, quiet

from gradaccum.app import Trainer, build_run
from gradaccum.app.folder import CHECKPOINT


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
