"""gradaccum.app.folder: a run folder's checkpoints carry their checksum, and kept ones are
copies of their own."""

import os

import pytest
import torch
from support.faults import flip_tensor_bit

from gradaccum.app.folder import CHECKPOINT, RunFolder


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"step": step, "accumulator": {"weights": torch.randn(64, 64), "items": 7}}


def test_a_flipped_bit_in_a_checkpoints_tensor_data_is_refused_naming_the_checksum(tmp_path):
    folder = RunFolder(tmp_path)
    folder.save_checkpoint(state(10))
    saved = folder.load_checkpoint(torch.device("cpu"))
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
        folder.load_checkpoint(torch.device("cpu"))


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    from gradaccum.app.folder import CHECKPOINT_FORMAT

    torch.save({"format": CHECKPOINT_FORMAT, **state(3)}, tmp_path / CHECKPOINT)
    assert RunFolder(tmp_path).load_checkpoint(torch.device("cpu"))["step"] == 3


def test_a_kept_checkpoint_is_a_copy_that_damage_to_the_live_one_leaves_whole(tmp_path):
    folder = RunFolder(tmp_path)
    folder.save_checkpoint(state(5))
    folder.keep_checkpoint(5, keep=2)
    [(step, kept)] = folder.kept_checkpoints()
    assert step == 5 and not os.path.samefile(kept, tmp_path / CHECKPOINT)
    with open(tmp_path / CHECKPOINT, "r+b") as f:
        f.truncate(100)  # truncating the live file once truncated its hard-linked "copy" too
    with pytest.raises(ValueError, match="cannot be read as a gradaccum checkpoint"):
        folder.load_checkpoint(torch.device("cpu"))
    assert folder.load_checkpoint(torch.device("cpu"), kept)["step"] == 5


def test_a_damaged_metrics_line_is_named_and_a_crashs_half_line_is_dropped(tmp_path):
    folder = RunFolder(tmp_path)
    lines = ['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}', '{"step": 3, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    folder.check_resumable()  # the half line at the end is what a crash leaves
    with folder.open_metrics(through_step=1) as f:
        f.write('{"step": 2, "loss": 1.25}\n')
    assert [x["loss"] for x in folder.metrics()] == [2.0, 1.25]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": true}\n{"step": 3}\n')
    with pytest.raises(
        ValueError, match=r"metrics.jsonl line 2 is damaged \('\{\"step\": true\}'\)"
    ):
        folder.check_resumable()


def test_a_plan_that_is_not_a_table_is_refused_naming_the_file(tmp_path):
    (tmp_path / "plan.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"plan.json holds a list \[1, 2\], not a table with "):
        RunFolder(tmp_path).check_resumable()
