"""gradaccum.app.folder: a run folder's metrics lines and JSON files, read back whole or
refused naming the file."""

import pytest

from gradaccum.app.folder import RunFolder


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


# -- a start that fails leaves nothing that refuses the same command --------------------------


def _opened(path, *, resume=False, said=None):
    folder = RunFolder(path)
    folder.open(resume=resume, log=(said.append if said is not None else lambda _: None))
    return folder


def test_a_failed_start_removes_the_folder_it_made_and_empties_the_one_it_found(tmp_path):
    made = _opened(tmp_path / "new")
    made.write_json("config.json", {"effective_batch": 8})
    made.abandon()
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    found = _opened(empty)
    found.write_json("config.json", {"effective_batch": 8})
    found.write_json("plan.json", {"micro_size": 8})
    found.abandon()
    assert empty.is_dir() and list(empty.iterdir()) == []


def test_a_run_that_trained_is_never_removed_by_abandon(tmp_path):
    folder = _opened(tmp_path / "run")
    folder.write_json("config.json", {"effective_batch": 8})
    folder.append_line("metrics.jsonl", {"step": 1})
    folder.abandon()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".lock",
        "config.json",
        "metrics.jsonl",
    ]


def test_a_killed_start_is_cleared_for_the_same_command_and_said_in_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "plan.json"):
        (run / name).write_text("{}")
    (run / ".lock").touch()
    (run / "checkpoint.pt.tmp").write_bytes(b"half")
    said: list[str] = []
    folder = _opened(run, said=said)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    assert len(said) == 1 and "never trained a step" in said[0] and "plan.json" in said[0]
    folder.release()
    only_lock = tmp_path / "lock-only"
    only_lock.mkdir()
    (only_lock / ".lock").touch()
    _opened(only_lock).release()  # what a kill right after the lock leaves: usable


def test_a_guard_step_0_checkpoint_is_not_training_but_a_later_one_is(tmp_path):
    folder = RunFolder(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    (tmp_path / "checkpoints" / "step-00000000.pt").write_bytes(b"x")
    assert not folder.trained()
    (tmp_path / "checkpoints" / "step-00000005.pt").write_bytes(b"x")
    assert folder.trained()
    (tmp_path / "checkpoints" / "step-00000000.pt").unlink()
    (tmp_path / "checkpoints" / "step-00000005.pt").unlink()
    assert folder.trained()  # checkpoint.pt without the guard: a step was trained


def test_someone_elses_folder_is_refused_and_left_exactly_as_it_was(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that are not a gradaccum run \(notes.txt\)"):
        _opened(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_the_second_of_two_starts_is_told_another_process_trains_there(tmp_path):
    first = _opened(tmp_path / "run")
    first.write_json("config.json", {"effective_batch": 8})
    first.append_line("metrics.jsonl", {"step": 1})  # trained: not a start to clear
    for resume in (False, True):
        with pytest.raises(ValueError, match="another process is training in"):
            _opened(tmp_path / "run", resume=resume)
    first.release()
    with pytest.raises(ValueError, match="already holds a run; continue it with --resume"):
        _opened(tmp_path / "run")


def test_every_run_folder_file_name_is_written_once_in_folder_py():
    """The run folder's names (config.json, checkpoint.pt, ...) appear as literals in
    folder.py alone; everything else names them by its constants. (The recipes read a Hugging
    Face model folder, whose config.json is another folder's file.)"""
    import ast
    from pathlib import Path

    from gradaccum.app import folder

    app = Path(folder.__file__).parent
    # the files' names (a folder's name, "shards" or "export", is also a key or an option's)
    names = {v for k, v in vars(folder).items() if k.isupper() and isinstance(v, str)}
    names = {v for v in names if "." in v}
    assert {"config.json", "checkpoint.pt", "metrics.jsonl", "report.html"} <= names
    found = []
    for file in app.rglob("*.py"):
        if file.name == "folder.py" or "recipes" in file.parts:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{file.relative_to(app)}:{node.lineno} {node.value!r}")
    assert found == []
