"""app/plan_cache.py: a plan is found again only for what it was measured on."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

import pytest
import torch
from helpers import cli, make_plan

from gradaccum.app import plan_cache
from gradaccum.app.planner import Planner
from gradaccum.planning import Plan, Probe

# the request make_plan(64)'s plans answer (its budget 2**30, margin 0.15)
SETTINGS = {"recipe": "gpt", "effective_batch": 64, "budget": 2**30, "precision": "fp32"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADACCUM_PLAN_CACHE")  # the tests' conftest turns it off elsewhere
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def parts(settings=None, paths=()):
    return plan_cache.signature(torch.device("cpu"), settings or SETTINGS, paths)


def test_the_same_settings_and_files_give_the_same_key_and_anything_else_another(tmp_path):
    """The key is known before the model is built: the same settings and files give the same
    key; another budget, precision, option of the model (LoRA's rank), recipe or data file
    another."""
    base = parts()
    assert plan_cache.key(parts()) == plan_cache.key(base)
    assert base["code"] == plan_cache.code_digest() and len(base["code"]) == 24
    data = tmp_path / "data.txt"
    data.write_text("some text\n")
    others = [
        parts(settings={**SETTINGS, "budget": 300_000_000}),
        parts(settings={**SETTINGS, "precision": "bf16"}),
        parts(settings={**SETTINGS, "recipe": "digits"}),
        parts(settings={**SETTINGS, "run": {"lora": 8}}),
        parts(paths=(str(data),)),
    ]
    keys = {plan_cache.key(p) for p in others}
    assert plan_cache.key(base) not in keys and len(keys) == len(others)
    before = plan_cache.key(parts(paths=(str(data),)))
    data.write_text("other text, longer\n")  # the data changed: its longest sequence may too
    assert plan_cache.key(parts(paths=(str(data),))) != before


def test_a_folder_named_relatively_or_absolutely_is_one_key(tmp_path, monkeypatch):
    """`--hf-model DIR` from the folder above and `--hf-model /abs/DIR` ask one question: the
    setting that names a path is keyed resolved (an estimate asked both ways traced twice)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    keys = {
        plan_cache.key(parts({**SETTINGS, "hf_model": name}, (name,)))
        for name in ("model", "./model", str(model), f"{tmp_path}/../{tmp_path.name}/model")
    }
    assert len(keys) == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert plan_cache.key(parts({**SETTINGS, "hf_model": "other"}, ("other",))) not in keys


def test_a_stored_plan_is_read_back_whole_and_a_damaged_file_is_never_trusted():
    probes = (Probe(4, 5_000_000, 1_000_000, 4.9e6), Probe(16, 9_000_000, 4e6, 8.8e6, "verify"))
    key, plan = parts(), dataclasses.replace(make_plan(64, micro=16), probes=probes)
    assert plan_cache.load(key) is None
    path = plan_cache.store(key, {**plan.to_dict(), "source": "planned"})
    assert path is not None and path.parent == plan_cache.folder()
    read, info, where = plan_cache.load(key)
    assert where == path and info["source"] == "planned"
    assert read == plan and read.summary() == plan.summary()
    # another key's file under this name (edited, or a collision): not this plan
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**stored["key"], "budget": 1}}))
    assert plan_cache.load(key) is None
    for damaged in ("{not json", json.dumps({"key": key, "plan": {"micro_size": "x"}}), "[]"):
        path.write_text(damaged)
        assert plan_cache.load(key) is None, damaged


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert plan_cache.store(parts(), make_plan(64, micro=16).to_dict()) is None
    assert plan_cache.load(parts()) is None


def test_gradaccum_plan_cache_names_another_folder_or_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "shared"))
    info = make_plan(64, micro=16).to_dict()
    assert plan_cache.store(parts(), info).parent == tmp_path / "shared"
    assert plan_cache.load(parts()) is not None
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", "off")
    assert plan_cache.folder() is None and plan_cache.load(parts()) is None
    assert plan_cache.store(parts(), info) is None


def test_from_dict_refuses_what_is_not_a_plan():
    with pytest.raises(ValueError, match="not a saved plan"):
        Plan.from_dict({"micro_size": 4})


def sha256_of(entry):
    """The entry's checksum computed here: the sha256 of its key and plan as canonical JSON."""
    body = {"key": entry["key"], "plan": entry["plan"]}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def resealed(entry, **plan):
    """The entry with ``plan``'s fields changed and its checksum recomputed: only the check of
    the plan itself can refuse it."""
    entry = {**entry, "plan": {**entry["plan"], **plan}}
    return json.dumps({**entry, "sha256": sha256_of(entry)})


def load_within(key, seconds=10.0):
    """plan_cache.load(key) in a thread: (what it returned, the lines it warned), or a
    failure if it has not returned within ``seconds`` (a FIFO's read would block forever)."""
    said, answer = [], []
    reader = threading.Thread(target=lambda: answer.append(plan_cache.load(key, said.append)))
    reader.daemon = True  # a blocked read must not hold pytest at exit
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), f"plan_cache.load blocked for more than {seconds} s"
    return answer[0], said


def test_an_entry_carries_the_checksum_of_its_contents():
    key, info = parts(), make_plan(64, micro=16).to_dict()
    path = plan_cache.store(key, info)
    entry = json.loads(path.read_text())
    assert entry["sha256"] == sha256_of(entry)
    assert plan_cache.load(key, pytest.fail) is not None  # a whole entry: no warning


def poisons(entry):
    """(name, how to poison the entry's path, what its one line must say)."""
    text = json.dumps(entry, indent=1)
    at = text.index('"predicted_peak": ') + len('"predicted_peak": ')
    flipped = text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :]  # one digit
    edited = json.dumps({**entry, "plan": {**entry["plan"], "micro_size": 0}})
    older = json.dumps({"key": entry["key"], "plan": entry["plan"]})  # no checksum
    return [
        ("micro_size 0, resealed", lambda p: p.write_text(resealed(entry, micro_size=0)),
         "micro_size must be an integer >= 1, got 0"),
        ("micro_size 0, edited", lambda p: p.write_text(edited), "does not match its checksum"),
        ("a flipped digit", lambda p: p.write_text(flipped), "does not match its checksum"),
        ("truncated", lambda p: p.write_text(text[: len(text) // 2]), "is not JSON"),
        ("no checksum", lambda p: p.write_text(older), "has no checksum"),
        ("a FIFO", lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
        ("a directory", lambda p: p.mkdir(), "is a directory, not a regular file"),
        ("a link to a FIFO", lambda p: (os.mkfifo(f"{p}.fifo"), p.symlink_to(f"{p}.fifo")),
         "is a FIFO (named pipe), not a regular file"),
        ("a link to nothing", lambda p: p.symlink_to(f"{p}.gone"), "symbolic link to nothing"),
        ("binary", lambda p: p.write_bytes(b"\xc2\x00" * 64), "is not UTF-8 text"),
    ]  # fmt: skip


def test_a_damaged_edited_or_unreadable_entry_is_named_in_one_line_and_planned_over():
    """Each poisoned entry: load returns within seconds, serves nothing and says, in one line
    naming the file, what is wrong; the planner then makes a new plan (micro-batch 16) and
    the next run reads it back (the file was replaced where the cache could write: not over
    a directory)."""
    key, plan = parts(), make_plan(64, micro=16)
    path = plan_cache.store(key, plan.to_dict())
    entry = json.loads(path.read_text())
    for name, poison, why in poisons(entry):
        for old in (path, path.with_name(f"{path.name}.fifo")):
            if old.is_dir() and not old.is_symlink():
                old.rmdir()
            elif os.path.lexists(old):
                old.unlink()
        poison(path)
        served, said = load_within(key)
        assert served is None, name
        assert len(said) == 1 and str(path) in said[0] and why in said[0], (name, said)
        assert said[0].endswith("planning over it") and "\n" not in said[0], said
        made, logged = [], []
        planner = Planner(torch.device("cpu"), SETTINGS, log=logged.append)
        assert planner.parts == key
        info = planner.plan(lambda made=made: made.append(1) or plan.to_dict())
        assert made == [1] and info["micro_size"] == 16, name
        assert not any("cached" in line for line in logged), (name, logged)
        if name != "a directory":  # a file, a FIFO or a link is replaced by the new plan
            again, said = load_within(key)
            assert said == [] and again[0] == plan, name


def test_a_plan_that_does_not_add_up_or_answers_another_request_is_not_served():
    """Entries whose checksum is right but whose plan is not one plan() makes for this
    request: each refused naming the field and both numbers."""
    key, plan = parts(), make_plan(64, micro=16)  # 4 x 16
    path = plan_cache.store(key, plan.to_dict())
    entry = json.loads(path.read_text())
    cases = [
        ({"micro_batches": 3}, "3 micro-batches of 16 with a last one of 16 do not make "
         "per_rank_batch 64"),
        ({"last_micro_size": 19, "micro_batches": 4, "micro_size": 15},  # 3 x 15 + 19 = 64
         "4 micro-batches of 15 with a last one of 19 do not make per_rank_batch 64"),
        ({"per_rank_batch": 32}, "effective_batch 64 is not world_size 1 x per_rank_batch 32"),
        ({"micro_size": 16.0}, "micro_size must be an integer >= 1, got 16.0"),
        ({"micro_size": True}, "micro_size must be an integer >= 1, got True"),
        ({"budget": 2**29}, "budget 536870912 is not the 1073741824 asked"),
        ({"precision": "bf16"}, "precision 'bf16' is not the 'fp32' asked"),
        ({"predicted_peak": 2.0**31}, "predicted_peak 2147483648.0 is not within the budget"),
        ({"micro_sizes": [16, 16, 16, 15]}, "micro_sizes [16, 16, 16, 15] are not the window's"),
        ({"phases": [{"name": "evaluation", "micro_size": 0, "peak_bytes": 1}]},
         "a phase's micro_size must be an integer >= 1, got 0"),
    ]  # fmt: skip
    for change, why in cases:
        path.write_text(resealed(entry, **change))
        served, said = load_within(key)
        assert served is None and len(said) == 1 and why in said[0], (change, said)
    # a ragged last micro-batch where the plan says so is a plan: 64 = 2 x 24 + 16
    ragged = make_plan(64, micro=24)
    assert ragged.micro_sizes == [24, 24, 16]
    path.write_text(resealed(entry, **ragged.to_dict()))
    served, said = load_within(key)
    assert said == [] and served[0] == ragged


@pytest.mark.slow  # two plans of the digits recipe, each in fresh processes
def test_gradaccum_plan_names_a_poisoned_entry_plans_over_it_and_exits_0(tmp_path, monkeypatch):
    """The issue's case end to end: a cached plan edited to micro-batch 0 (its checksum
    recomputed, so only the plan's own check can see it) is named and planned over by
    `gradaccum plan`, which prints a positive micro-batch and exits 0."""
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "plans"))
    # --prefer largest: the size is the memory's answer, not a race a loaded machine decides
    args = ["plan", "--recipe", "digits", "--effective-batch", "8", "--budget", "300MB", "--json",
            "--prefer", "largest"]  # fmt: skip
    first = cli(*args)
    (path,) = (tmp_path / "plans").glob("*.json")
    path.write_text(resealed(json.loads(path.read_text()), micro_size=0))
    again = cli(*args, timeout=120)
    warned = [x for x in again.stderr.splitlines() if str(path) in x]
    assert len(warned) == 1 and "micro_size must be an integer >= 1, got 0" in warned[0]
    assert "the plan is the cached one" not in again.stderr and "probing" in again.stderr
    planned = json.loads(again.stdout)
    assert again.returncode == 0 and planned["micro_size"] == json.loads(first.stdout)["micro_size"]
    assert planned["micro_size"] >= 1
