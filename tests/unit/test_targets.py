"""Targets: durations, and which target a window meets or a limit it reaches."""

import pytest

from gradaccum.app.targets import Targets, parse_seconds


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), (45, 45)]
)
def test_durations(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "-5s", "0", "5d"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="duration"):
        parse_seconds(text)


def line(step, peak=100, **evals):
    return {"step": step, "samples": step * 10, "peak_memory": peak, **evals}


def test_a_quality_target_is_judged_only_at_evaluations_and_records_when():
    t = Targets(target_loss=2.0, target_accuracy=0.9)
    assert t.check(line(1), 1.0) is None
    assert t.check(line(2, eval_loss=2.5, eval_accuracy=0.8), 2.0) is None
    assert t.check(line(3), 3.0) is None  # no evaluation: nothing to judge
    assert t.check(line(4, eval_loss=1.9, eval_accuracy=0.85), 4.0) == "target_loss"
    s = t.summary()
    assert s["target_loss"] == {
        "limit": 2.0,
        "status": "met",
        "value": 1.9,
        "step": 4,
        "samples": 40,
        "seconds": 4.0,
    }
    assert s["target_accuracy"]["status"] == "missed" and s["target_accuracy"]["value"] == 0.85
    assert s["max_time"]["status"] == "not set" and s["max_memory"]["limit"] is None


def test_cost_limits_are_reached_or_stayed_within():
    t = Targets(max_time=10.0, max_memory=1000)
    assert not t.limit_reached(9.9, 999)
    assert t.check(line(1, peak=999), 9.9) is None
    assert t.limit_reached(10.0, 999)
    assert t.check(line(2, peak=999), 10.0) == "max_time"
    s = t.summary()
    assert s["max_time"]["status"] == "reached" and s["max_time"]["step"] == 2
    assert s["max_memory"] == {
        "limit": 1000,
        "status": "within",
        "value": 999,
        "step": None,
        "samples": None,
        "seconds": None,
    }
    assert Targets(max_memory=1000).check(line(3, peak=1000), 0.0) == "max_memory"
