"""gradaccum.app.planning: the run's micro-batch, and library advice in the command's flags."""

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

    from gradaccum.plan import _too_small

    text = as_flags(_too_small(torch.nn.Linear(2, 2), 1000, 0.15, False, 1e7, measured=False))
    assert text.endswith("give at least 11.2 MiB or allow --checkpointing auto"), text


def test_a_given_micro_batch_is_recorded_as_a_plan_without_measuring(tmp_path):
    import json

    cfg = TrainConfig.of(
        recipe="digits", micro_batch=8, effective_batch=16, steps=2, out=str(tmp_path / "run")
    )
    summary = train(cfg, log=lambda *a, **k: None)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan == {"micro_size": 8, "source": "given", "checkpointing": False}
    assert summary["steps"] == 2
