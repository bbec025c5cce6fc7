"""app/plan_cache.py: a plan is found again only for what it was measured on."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import make_plan

from gradaccum.app import plan_cache
from gradaccum.plan import Plan, Probe

SETTINGS = {"recipe": "gpt", "effective_batch": 64, "budget": 200_000_000, "precision": "fp32"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADACCUM_PLAN_CACHE")  # the tests' conftest turns it off elsewhere
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def parts(model=None, sample=None, settings=None, paths=()):
    model = model or torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    sample = sample if sample is not None else (torch.zeros(8, 4), torch.zeros(8))
    cpu = torch.device("cpu")
    return plan_cache.signature(model, optimizer, sample, cpu, settings or SETTINGS, paths)


def test_the_same_model_data_and_settings_give_the_same_key_and_anything_else_another(tmp_path):
    torch.manual_seed(0)
    base = parts()
    torch.manual_seed(1)  # other weights: memory does not depend on values
    assert plan_cache.key(parts()) == plan_cache.key(base)
    frozen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    frozen[0].requires_grad_(False)  # as LoRA freezes its base: no gradients, no state
    data = tmp_path / "data.txt"
    data.write_text("some text\n")
    others = [
        parts(settings={**SETTINGS, "budget": 300_000_000}),
        parts(settings={**SETTINGS, "precision": "bf16"}),
        parts(sample=(torch.zeros(8, 5), torch.zeros(8))),  # longer sequences
        parts(sample=(torch.zeros(8, 4, dtype=torch.float64), torch.zeros(8))),
        parts(model=frozen),
        parts(model=torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Linear(9, 2))),
        parts(paths=(str(data),)),
    ]
    keys = {plan_cache.key(p) for p in others}
    assert plan_cache.key(base) not in keys and len(keys) == len(others)
    before = plan_cache.key(parts(paths=(str(data),)))
    data.write_text("other text, longer\n")  # the data changed: its longest sequence may too
    assert plan_cache.key(parts(paths=(str(data),))) != before


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
