"""gradaccum.app.planning: the run's micro-batch, and library advice in the command's flags."""

import pytest

from gradaccum.app import TrainConfig, train
from gradaccum.app.planning import as_flags


def test_library_advice_is_translated_into_flags():
    assert as_flags("or allow checkpointing='auto'") == "or allow --checkpointing auto"
    assert as_flags("try schedule='1f1b'; budget=2GiB") == (
        "try --pipeline-schedule 1f1b; --budget 2GiB"
    )
    assert as_flags("a larger budget or checkpointing") == "a larger budget or checkpointing"


def test_the_planners_own_advice_reads_as_flags():
    import torch

    from gradaccum.planning import too_small

    text = as_flags(too_small(torch.nn.Linear(2, 2), 1000, 0.15, False, 1e7, measured=False))
    assert text.endswith("give at least 11.2 MiB or allow --checkpointing auto"), text


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_given_micro_batch_is_recorded_as_a_plan_without_measuring(tmp_path):
    import json

    cfg = TrainConfig.of(
        recipe="digits", micro_batch=8, effective_batch=16, steps=2, out=str(tmp_path / "run")
    )
    summary = train(cfg, log=lambda *a, **k: None)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan == {"micro_size": 8, "source": "given", "checkpointing": False}
    assert summary["steps"] == 2


@pytest.mark.slow  # a planned run measured phase by phase: the slow tier
def test_a_planned_run_measures_its_phases_and_keeps_them_beside_the_plans(tmp_path):
    """The plan covers evaluation and checkpoints as well as the window (plan.json's
    phases), and the run writes what each phase peaked at (memory.json), by one meter: the
    whole run's peak is the largest phase's, within the budget."""
    import json

    from gradaccum.memory import parse_bytes

    out = tmp_path / "run"
    cfg = TrainConfig.of(
        recipe="digits", effective_batch=32, budget="200MB", steps=2, eval_every=1,
        checkpoint_every=1, out=str(out),
    )  # fmt: skip
    train(cfg, log=lambda *a, **k: None)
    plan = json.loads((out / "plan.json").read_text())
    assert [p["name"] for p in plan["phases"]] == ["evaluation", "checkpoint"]
    assert all(0 < p["peak_bytes"] <= 0.85 * parse_bytes("200MB") for p in plan["phases"])
    memory = json.loads((out / "memory.json").read_text())
    assert set(memory["phases"]) >= {"training", "evaluation", "checkpoint"}
    assert memory["peak"] == max(memory["phases"].values())
    assert memory["peak"] <= parse_bytes("200MB")


@pytest.mark.slow  # a planned run measured phase by phase: the slow tier
def test_evaluation_runs_at_the_plans_own_micro_batch_for_it_resumed_too(tmp_path, monkeypatch):
    """A plan that gave evaluation a micro-batch of its own (plan.json's evaluation phase)
    is followed by every evaluation of the run, a resumed session's included."""
    import json

    from gradaccum.app.recipes import DigitsData

    out = tmp_path / "run"
    given = dict(recipe="digits", micro_batch=8, effective_batch=16, eval_every=1, out=str(out))
    train(TrainConfig.of(steps=1, **given), log=lambda *a, **k: None)
    plan = json.loads((out / "plan.json").read_text())
    plan["phases"] = [{"name": "evaluation", "micro_size": 3, "peak_bytes": 1, "tried": []}]
    (out / "plan.json").write_text(json.dumps(plan))
    sizes = []
    evaluate = DigitsData.evaluate

    def spy(self, model, micro_size, limit=None):
        sizes.append(micro_size)
        return evaluate(self, model, micro_size, limit)

    monkeypatch.setattr(DigitsData, "evaluate", spy)
    train(TrainConfig.of(resume=str(out), steps=3, **given), log=lambda *a, **k: None)
    assert sizes and set(sizes) == {3}


def test_a_runs_plan_is_keyed_by_what_shapes_its_memory_and_not_by_its_length_or_lr():
    """train's cache key is known before the model is built: the run's options less its
    length, cadences, output and learning rate. A longer run or another learning rate finds
    the same plan; another sequence length, LoRA rank, precision or export does not."""
    from gradaccum.app import plan_cache
    from gradaccum.app.planning import cache_settings, request

    def key(**options):
        cfg = TrainConfig.of(recipe="gpt", **options)
        asked = request(cfg, 1, each_rank=False)
        return plan_cache.key(cache_settings(cfg, asked, 1))

    base = key()
    same = [key(steps=999), key(lr=0.1), key(eval_every=7), key(out="elsewhere")]
    assert set(same) == {base}
    other = [key(seq_len=32), key(lora=8), key(precision="bf16"), key(merge_lora=True)]
    assert base not in other and len(set(other)) == len(other)


def test_a_runs_cached_plan_is_said_before_its_model_and_data_are_built(tmp_path, monkeypatch):
    """`gradaccum train`'s key is known from its configuration (``cache_settings``): a
    stored plan is answered before the recipe's model is built and its data loaded, so a
    rerun says its plan at once; the run then trains at the stored size (16, made up: no
    measurement of digits gives it)."""
    import dataclasses
    import json

    import torch
    from helpers import make_plan

    from gradaccum.app import build
    from gradaccum.app.planner import Planner
    from gradaccum.app.planning import cache_settings, request

    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "plans"))
    cfg = TrainConfig.of(
        recipe="digits", effective_batch=64, budget="300MB", steps=1, out=str(tmp_path / "run")
    )
    Planner(
        torch.device("cpu"), cache_settings(cfg, request(cfg, 1, each_rank=False), 1),
        (None, None), log=print,
    ).keep(dataclasses.replace(make_plan(64, micro=16), budget=300_000_000).to_dict())  # fmt: skip
    said = []
    real = build.get_recipe

    def watched(name):
        recipe = real(name)
        make_model, make_data = recipe.build_model, recipe.make_data

        def build_model():
            said.append("model built")
            return make_model()

        def make_data_(seed):
            said.append("data loaded")
            return make_data(seed)

        return dataclasses.replace(recipe, build_model=build_model, make_data=make_data_)

    monkeypatch.setattr(build, "get_recipe", watched)
    train(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    cached = next(i for i, line in enumerate(said) if line.startswith("the plan is the cached"))
    assert cached < said.index("model built") < said.index("data loaded"), said[:8]
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["micro_size"] == 16
