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

    from gradaccum.plan import too_small

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
        asked = request(cfg, cfg.batch.effective_batch, each_rank=False)
        return plan_cache.key(cache_settings(cfg, asked, 1))

    base = key()
    same = [key(steps=999), key(lr=0.1), key(eval_every=7), key(out="elsewhere")]
    assert set(same) == {base}
    other = [key(seq_len=32), key(lora=8), key(precision="bf16"), key(merge_lora=True)]
    assert base not in other and len(set(other)) == len(other)
