"""The incident guard's judgement, on loss and gradient-norm sequences with known spikes."""

import random

import pytest

from gradaccum.app.guard import IncidentGuard


def feed(guard, values, norms=None, skipped=None):
    """Judge each window; the indices (and kinds) of those found to be incidents."""
    found = []
    for i, loss in enumerate(values):
        norm = 1.0 if norms is None else norms[i]
        incident = guard.check(loss, norm, bool(skipped and i in skipped))
        if incident is not None:
            found.append((i, incident.kind))
    return found


def noisy(n, level=2.5, noise=0.05, seed=0):
    rng = random.Random(seed)
    return [level + rng.gauss(0, noise) for _ in range(n)]


def test_a_steady_noisy_run_raises_no_alarm():
    for seed in range(5):
        assert feed(IncidentGuard(), noisy(500, seed=seed), noisy(500, 1.0, 0.2, seed + 9)) == []


def test_a_falling_loss_is_training_not_an_incident():
    losses = [5.5 * 0.97**i + 0.02 * random.Random(i).random() for i in range(300)]
    assert feed(IncidentGuard(), losses) == []


def test_a_loss_spike_is_caught_where_it_happens_and_not_learned():
    losses = noisy(100)
    losses[60] = 4.5  # far above 2.5 +- 0.05, and above the band's floor (60% of 2.5)
    losses[61] = 4.5  # a second one right after: the first did not widen the band
    found = feed(IncidentGuard(), losses)
    assert found == [(60, "loss spike"), (61, "loss spike")]


def test_a_gradient_spike_with_an_ordinary_loss_is_caught():
    norms = noisy(100, 1.0, 0.1, seed=3)
    norms[70] = 9.0
    assert feed(IncidentGuard(), noisy(100), norms) == [(70, "gradient spike")]


def test_no_spike_is_judged_during_warmup_but_a_divergence_is():
    losses = noisy(30)
    losses[5] = 20.0  # 8x the first window's: a spike, unjudged while there is no history
    assert feed(IncidentGuard(warmup=20), losses) == []
    losses[5] = 26.0  # 10x and more: the optimization diverging, from the first windows on
    [(at, kind)] = feed(IncidentGuard(warmup=20), losses)
    assert (at, kind) == (5, "divergence")
    guard = IncidentGuard()
    incident = [guard.check(x, 1.0, False) for x in [2.4, 3.5e6]][-1]
    assert incident.kind == "divergence" and not incident.blames_data
    assert incident.seen == {"loss": 3.5e6, "first_loss": 2.4}


def test_a_converged_classifiers_hard_sample_is_not_a_spike_but_chance_level_is():
    """A classifier's loss falls from chance level (2.3 for ten classes) toward zero; one hard
    sample in a small window then lifts the window's mean far above the median on clean
    data (digits at --effective-batch 16 does: bench/results/guard.md). The band stays a
    share of the loss's own scale, so that is no incident; a window at chance level (random
    labels) still is."""
    rng = random.Random(0)
    losses = [2.3 * 0.9**i for i in range(40)] + [0.03 + 0.01 * rng.random() for _ in range(60)]
    hard = [*losses, 0.9]
    assert feed(IncidentGuard(), hard) == []
    assert feed(IncidentGuard(), [*losses, 2.3]) == [(100, "loss spike")]
    assert feed(IncidentGuard(floor=0.05), hard) == [(100, "loss spike")]  # half the floor


def test_the_floor_keeps_a_plateau_from_alarming_on_a_wobble():
    flat = [2.0] * 60 + [2.05]  # no spread at all, then 2.5% higher
    assert feed(IncidentGuard(), flat) == []
    # the band: 6 x 10% of the loss's scale above the median
    assert feed(IncidentGuard(), [2.0] * 60 + [3.15]) == []
    assert feed(IncidentGuard(), [2.0] * 60 + [3.25]) == [(60, "loss spike")]


def test_a_run_of_skipped_windows_is_an_incident_blaming_them_all():
    guard = IncidentGuard(skipped_windows=3)
    found = []
    for i in range(10):
        incident = guard.check(None, float("inf"), skipped=i in (2, 4, 5, 6))
        if incident is not None:
            found.append((i, incident.kind, incident.windows))
    assert found == [(6, "skipped windows", 3)]  # 2 alone is not a run


def test_state_round_trip_judges_alike():
    losses = noisy(80, seed=4)
    losses[75] = 9.0
    whole = IncidentGuard()
    first = feed(whole, losses)
    part = IncidentGuard()
    feed(part, losses[:50])
    again = IncidentGuard()
    again.load_state_dict(part.state_dict())
    second = [(i + 50, kind) for i, kind in feed(again, losses[50:])]
    assert first == second == [(75, "loss spike")]


@pytest.mark.parametrize(
    "kwargs",
    [{"history": 0}, {"warmup": 60, "history": 50}, {"threshold": -1}, {"skipped_windows": 1.5}],
)
def test_bad_settings_are_refused_naming_the_value(kwargs):
    with pytest.raises(
        ValueError, match=next(iter(kwargs)) if "warmup" not in kwargs else "warmup"
    ):
        IncidentGuard(**kwargs)


def test_margins_place_a_window_against_the_band():
    guard = IncidentGuard(warmup=20, floor=0.0)
    losses = noisy(40, level=2.0, noise=0.05, seed=11)
    assert guard.margins(9.0, 1.0) is None  # warm-up: nothing judged yet
    feed(guard, losses)
    median, highest = guard.band(guard._losses)
    assert guard.margins(median, 1.0)["loss"] == 0.0
    assert abs(guard.margins(highest, 1.0)["loss"] - 1.0) < 1e-12
    assert guard.check(highest + 1e-9, 1.0, False).kind == "loss spike"


def test_without_gradient_judgement_only_the_loss_counts():
    norms = noisy(100, 1.0, 0.1, seed=3)
    norms[70] = 9.0  # clipping bounded this step: not an incident
    losses = noisy(100)
    losses[80] = 4.5
    assert feed(IncidentGuard(gradient=False), losses, norms) == [(80, "loss spike")]


def test_a_rollback_restores_the_kept_state_sets_the_samples_aside_and_records_it(tmp_path):
    """A real digits run: its step-0 checkpoint kept, the model then changed (a window gone
    bad), an incident blamed on the window of samples 0 to 16: the run is back at step 0 with
    those samples set aside, and incidents.jsonl says so."""
    from types import SimpleNamespace

    import torch
    from support.runs import digits_run

    from gradaccum.app.checkpoints import Checkpointer, Checkpoints
    from gradaccum.app.guard import Incident, Probe, Rollback

    run = digits_run(tmp_path / "run")
    said = []
    try:
        store = Checkpoints(run.folder)
        saver = Checkpointer(store, run.kind, run.acc, run.state_dict, every=3, keep=2, start=0)
        saver.save(0)
        good = {k: v.clone() for k, v in run.model.state_dict().items()}
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(1.0)
        run.progress.schedule.step, run.progress.schedule.samples = 1, 16
        probe = Probe(run.folder, run.data, run.model, run.recipe.loss_fn, 6, run.device, run.kind)
        rollback = Rollback(
            run.guard, store, saver, run.restore, run.progress, probe, said.append
        )  # fmt: skip
        window = SimpleNamespace(loss=9.0, grad_norm=1.0, skipped=None)
        rollback.check(1, 0, 16, window)
        spike = Incident("loss spike", 1, {"loss": 9.0, "median": 2.0})
        assert rollback.roll_back(spike) is False  # not given up: training goes on
        assert all(torch.equal(run.model.state_dict()[k], v) for k, v in good.items())
        p = run.progress
        assert p.step == 0 and p.skips == [[0, 16]] and p.schedule.samples == 16
        assert p.retries == 1 and p.last_incident == 1
        [record] = run.folder.lines("incidents.jsonl")
        assert record["kind"] == "loss spike" and record["rolled_back_to"] == 0
        assert record["samples"] == [0, 16] and record["retry"] == 1
        assert said == [
            "incident at step 1: loss spike (loss 9, median 2); rolled back to step 0; samples "
            "0 to 16 set aside (rollback 1 of at most 3 in a row)"
        ]
    finally:
        run.folder.release()
