"""gradaccum.app.checkpoints: the checkpoint files (sealed with their checksum, kept copies of
their own) and the Checkpointer's cadence and writes, on a real run built in-process."""

import os

import pytest
import torch
from support.faults import flip_tensor_bit
from support.runs import digits_run

from gradaccum.app.boundary import Boundary
from gradaccum.app.checkpoints import CHECKPOINT_FORMAT, Checkpointer, Checkpoints
from gradaccum.app.folder import CHECKPOINT, RunFolder


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"step": step, "accumulator": {"weights": torch.randn(64, 64), "items": 7}}


def test_a_flipped_bit_in_a_checkpoints_tensor_data_is_refused_naming_the_checksum(tmp_path):
    store = Checkpoints(RunFolder(tmp_path))
    store.save(state(10))
    saved = store.load(torch.device("cpu"))
    assert saved["step"] == 10 and torch.equal(
        saved["accumulator"]["weights"], state(10)["accumulator"]["weights"]
    )
    assert "sha256" not in saved  # the checksum is checked, not handed on
    flip_tensor_bit(tmp_path / CHECKPOINT, byte=1000, bit=3)
    with pytest.raises(
        ValueError,
        match=r"checkpoint.pt is damaged: its contents do not match "
        r"the checksum written with it \(step 10\)",
    ):
        store.load(torch.device("cpu"))


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    torch.save({"format": CHECKPOINT_FORMAT, **state(3)}, tmp_path / CHECKPOINT)
    assert Checkpoints(RunFolder(tmp_path)).load(torch.device("cpu"))["step"] == 3


def test_a_kept_checkpoint_is_a_copy_that_damage_to_the_live_one_leaves_whole(tmp_path):
    store = Checkpoints(RunFolder(tmp_path))
    store.save(state(5))
    store.keep(5, keep=2)
    [(step, kept)] = store.kept()
    assert step == 5 and not os.path.samefile(kept, tmp_path / CHECKPOINT)
    with open(tmp_path / CHECKPOINT, "r+b") as f:
        f.truncate(100)  # truncating the live file once truncated its hard-linked "copy" too
    with pytest.raises(ValueError, match="cannot be read as a gradaccum checkpoint"):
        store.load(torch.device("cpu"))
    assert store.load(torch.device("cpu"), kept)["step"] == 5


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_the_checkpointer_saves_at_its_cadence_the_end_a_stop_and_a_target(tmp_path):
    run = digits_run(tmp_path / "run")
    try:
        store = Checkpoints(run.folder)
        saver = Checkpointer(store, run.kind, run.acc, run.state_dict, every=3, keep=2, start=0)
        assert [s for s in range(1, 8) if saver.due(Boundary(s, end=False, limit=False))] == [
            3,
            6,
        ]
        assert saver.due(Boundary(4, end=True, limit=False))
        assert saver.due(Boundary(4, end=False, limit=False, stopping=True))
        assert saver.due(Boundary(4, end=False, limit=False, hit="target_loss"))
        for step in (3, 6, 9):
            saver.save(step)
        saved = store.load(torch.device("cpu"))
        assert saved["step"] == 9 and saver.last == 9
        assert saved["micro_batch"] == 6 and saved["signature"] == run.signature
        assert set(saved["accumulator"]["model"]) == set(run.model.state_dict())
        assert [s for s, _ in store.kept()] == [6, 9]  # the last two kept
    finally:
        run.folder.release()


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_failed_write_says_what_is_kept_and_how_to_continue(tmp_path):
    run = digits_run(tmp_path / "run")
    try:
        saver = Checkpointer(
            Checkpoints(run.folder), run.kind, run.acc, run.state_dict, every=3, keep=None,
            start=0,
        )  # fmt: skip
        # as after a first step: the folder stays (a start that trained nothing is removed)
        (run.folder.path / "metrics.jsonl").write_text('{"step": 1}\n')
        assert "no checkpoint yet" in saver.stopped("disk full")
        saver.save(0)  # the guard's first checkpoint, of step 0
        said = saver.stopped("disk full")
        assert "its last checkpoint (step 0) is kept" in said, said
        assert said.endswith(f"continue with: gradaccum train --resume {run.folder.path}")
    finally:
        run.folder.release()
