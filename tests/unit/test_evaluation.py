"""gradaccum.app.evaluation: when a run evaluates, and its held-out numbers at the end."""

from types import SimpleNamespace

import torch

from gradaccum.app.boundary import Boundary
from gradaccum.app.evaluation import Evaluator


class Data:
    def __init__(self):
        self.calls = []

    def evaluate(self, model, size):
        self.calls.append((model, size))
        return {"loss": 1.5, "accuracy": 0.25}


def kind(main=True, evaluates=True):
    return SimpleNamespace(
        main=main, evaluates=lambda: evaluates, evaluated=lambda m: m, agree=lambda v: v
    )


def test_it_evaluates_every_n_steps_at_the_end_and_at_a_limit():
    ev = Evaluator(kind(), Data(), torch.nn.Linear(2, 2), 8, every=5)
    assert [s for s in range(1, 12) if ev.due(Boundary(s, end=False, limit=False))] == [5, 10]
    assert ev.due(Boundary(7, end=True, limit=False)) and ev.due(Boundary(7, end=False, limit=True))


def test_a_process_that_does_not_evaluate_is_never_due_and_reports_nothing():
    data = Data()
    ev = Evaluator(kind(main=False, evaluates=False), data, torch.nn.Linear(2, 2), 8, every=1)
    assert not ev.due(Boundary(1, end=True, limit=True))
    assert ev.final(None) is None and data.calls == []


def test_the_end_reads_the_last_line_or_evaluates_when_it_has_none():
    data, model = Data(), torch.nn.Linear(2, 2)
    ev = Evaluator(kind(), data, model, 8, every=5)
    assert ev.final({"step": 5, "loss": 2.0, "eval_loss": 0.5}) == {"loss": 0.5}
    assert data.calls == []
    assert ev.final({"step": 6, "loss": 2.0}) == {"loss": 1.5, "accuracy": 0.25}
    assert data.calls == [(model, 8)]
    worker = Evaluator(kind(main=False), Data(), model, 8, every=5)  # evaluates together
    assert worker.final(None) is None and len(worker.data.calls) == 1


class SlowData:
    """A held-out set of many forwards; a stop signal arrives during the third."""

    def __init__(self, stops):
        self.stops, self.forwards = stops, 0

    def evaluate(self, model, size):
        for _ in range(100):
            self.forwards += 1
            if self.forwards == 3:
                self.stops.append(15)  # SIGTERM noted by the run's handler
            model(torch.zeros(1, 2))
        return {"loss": 1.0}


def test_a_stop_signal_abandons_the_evaluation_in_progress():
    """It ran the whole held-out set (118 s, 12.5 minutes with 50 MB of data) before the
    checkpoint and the exit, so a scheduler's grace period ended in SIGKILL (issue 58)."""
    stops = []
    data = SlowData(stops)
    ev = Evaluator(kind(), data, torch.nn.Linear(2, 2), 8, every=1, stopped=lambda: bool(stops))
    assert ev.evaluate() == {}
    assert data.forwards == 3  # the forward after the signal never ran
    assert ev.evaluate() == {} and data.forwards == 3  # a stop already noted: none begins


def test_after_a_signal_stop_the_end_evaluates_nothing():
    data = Data()
    ev = Evaluator(kind(), data, torch.nn.Linear(2, 2), 8, every=5)
    assert ev.final({"step": 6, "loss": 2.0}, signal=True) == {}
    assert data.calls == []  # the resume evaluates instead


def test_processes_that_evaluate_together_finish_together():
    stops = []
    data = SlowData(stops)
    together = SimpleNamespace(**vars(kind()), together=True)
    ev = Evaluator(together, data, torch.nn.Linear(2, 2), 8, every=1, stopped=lambda: bool(stops))
    assert ev.evaluate() == {"loss": 1.0} and data.forwards == 100
