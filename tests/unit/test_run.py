"""gradaccum.app.run: the run's progress, and the checkpoint body a Run saves and restores."""

import pytest
import torch
from support.runs import digits_run

from gradaccum.app.run import Progress
from gradaccum.schedule import BatchSchedule


def test_progress_in_steps_and_in_samples():
    steps = Progress(BatchSchedule("constant", start=8, unit=8), 10, None)
    steps.schedule.step = 4
    assert steps.fraction() == 0.4 and not steps.done() and steps.length() == "10 steps"
    samples = Progress(BatchSchedule("constant", start=8, unit=8), None, 20)
    samples.schedule.samples = 16
    assert samples.next_size() == 4  # the last window cut to what is left
    assert samples.length() == "20 samples"


def test_samples_set_aside_are_skipped_and_a_window_past_the_incident_resets_the_count():
    p = Progress(BatchSchedule("constant", start=8, unit=8), 10, None)
    p.schedule.samples = 8
    p.set_aside([(8, 16), (16, 24)], step=3)
    assert p.schedule.samples == 24 and p.retries == 1 and p.last_incident == 3
    p.set_aside([(8, 16)], step=3)  # the same span again is not added twice
    assert p.skips == [[8, 16], [16, 24]] and p.retries == 2
    p.passed(3)
    assert p.retries == 2
    p.passed(4)
    assert p.retries == 0


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_runs_state_restores_into_a_fresh_run(tmp_path):
    first = digits_run(tmp_path / "a")
    try:
        first.progress.schedule.step, first.progress.schedule.samples = 5, 80
        first.progress.skips, first.progress.elapsed = [[16, 32]], 12.5
        first.targets.observed = {"max_time": {"value": 12.5}}
        with torch.no_grad():
            for p in first.model.parameters():
                p.add_(1.0)
        saved = first.state_dict(5, first.acc.state_dict())
    finally:
        first.folder.release()
    second = digits_run(tmp_path / "b")
    try:
        second.restore(saved)
        p = second.progress
        assert (p.step, p.schedule.samples, p.start) == (5, 80, 5)
        assert p.skips == [[16, 32]] and p.elapsed == 12.5
        assert second.targets.observed == {"max_time": {"value": 12.5}}
        for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        second.folder.release()
