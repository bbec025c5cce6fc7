"""The incident guard in a real run: corrupted windows are found, rolled back and skipped,
sample for sample, and the guarded run then trains exactly as a clean run that never saw
those samples (an independent reference: its data stream remapped, no guard involved)."""

import json
import os
import signal

import pytest
import torch
from helpers import cli, run_lines
from support.faults import corrupt_samples, rewrite_checkpoint, train_with_faults

from gradaccum.app import Interrupted, TrainConfig, train
from gradaccum.app.recipes import DigitsData

torch.set_num_threads(1)

BATCH, STEPS, BAD_STEPS = 32, 40, (25, 26, 33)  # all in digits' first epoch (1,437 samples)


def run(out, guard=True, faults=None, **kwargs):
    settings = {
        "recipe": "digits",
        "steps": STEPS,
        "effective_batch": BATCH,
        "micro_batch": 16,
        "checkpoint_every": 10,
        "eval_every": 1000,
        "noise_scale": False,
        "tensorboard": False,
        "guard": guard,
        "out": str(out),
    }
    cfg = TrainConfig.of(**{**settings, **kwargs})
    quiet = lambda *a, **k: None  # noqa: E731
    return train(cfg, log=quiet) if faults is None else train_with_faults(cfg, faults, quiet)


lines = run_lines


def weights(folder):
    saved = torch.load(folder / "checkpoint.pt", weights_only=True)
    return saved["accumulator"]["model"]


def test_guard_rolls_back_and_skips_exactly_the_corrupted_windows(tmp_path):
    clean = run(tmp_path / "clean")
    assert clean["incidents"] == 0  # no false alarm on the clean run
    ends = {0: 0, **{x["step"]: x["samples"] for x in lines(tmp_path / "clean")}}
    bad = [[ends[s - 1], ends[s]] for s in BAD_STEPS]  # those windows' samples exactly

    guarded = run(tmp_path / "guard", faults=corrupt_samples(bad))
    incidents = lines(tmp_path / "guard", "incidents.jsonl")
    assert [i["samples"] for i in incidents] == bad
    assert [(i["step"], i["rolled_back_to"], i["kind"]) for i in incidents] == [
        (25, 20, "loss spike"),
        (25, 20, "loss spike"),  # window 26's samples arrive at step 25 after the skip
        (31, 30, "loss spike"),  # window 33's at step 31
    ]
    assert guarded["incidents"] == 3 and guarded["steps"] == STEPS
    assert guarded["noise_advice"] == "gradient noise scale: not measured (--no-noise-scale)"
    assert [x["step"] for x in lines(tmp_path / "guard")] == list(range(1, STEPS + 1))

    # The reference: no corruption, no guard; position p reads the clean stream from p + the
    # samples set aside before it, so it never sees them.
    data = DigitsData(0)

    def sum_before(position):
        shift = 0
        for a, b in bad:
            if a <= position + shift:
                shift += b - a
        return shift

    def shifted(position, batch):
        return data.batch(position + sum_before(position), len(batch[1]))

    run(tmp_path / "reference", guard=False, faults=shifted)
    mine, ref = lines(tmp_path / "guard"), lines(tmp_path / "reference")
    assert [x["loss"] for x in mine] == [x["loss"] for x in ref]
    for name, tensor in weights(tmp_path / "reference").items():
        assert torch.equal(weights(tmp_path / "guard")[name], tensor), name

    # Without the guard the corrupted windows are trained on: their loss is there to see,
    # and the damage to the held-out loss is measured against the clean run.
    unguarded = run(tmp_path / "noguard", guard=False, faults=corrupt_samples(bad))
    spikes = [x["loss"] for x in lines(tmp_path / "noguard") if x["step"] in BAD_STEPS]
    assert min(spikes) > 3 * max(x["loss"] for x in ref[20:24])
    print(
        f"held-out loss: clean {clean['held_out_loss']:.4f}, guarded "
        f"{guarded['held_out_loss']:.4f}, unguarded {unguarded['held_out_loss']:.4f}"
    )


def test_a_resumed_run_makes_the_same_decision(tmp_path):
    """SIGTERM after the first two rollbacks (the checkpoint rolled back to holds the samples
    set aside), then resumed: it ends exactly as the uninterrupted guarded run."""
    ends = [0]
    data = DigitsData(0)
    for _ in range(STEPS):
        ends.append(ends[-1] + len(data.batch(ends[-1], BATCH)[1]))
    bad = [[ends[s - 1], ends[s]] for s in BAD_STEPS]
    whole = tmp_path / "whole"
    run(whole, faults=corrupt_samples(bad))

    corrupt, signalled = corrupt_samples(bad), []

    def stop_at_step_27(position, batch):
        if position == ends[28] and not signalled:  # step 27's window, after the skips
            signalled.append(os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)  # checkpointed at the window's end
        return corrupt(position, batch)

    part = tmp_path / "part"
    with pytest.raises(Interrupted):
        run(part, faults=stop_at_step_27)
    assert len(lines(part, "incidents.jsonl")) == 2
    assert torch.load(part / "checkpoint.pt", weights_only=True)["step"] == 27
    resumed = run(part, faults=corrupt, resume=str(part))
    assert resumed["incidents"] == 3
    assert lines(part, "incidents.jsonl") == lines(whole, "incidents.jsonl")
    assert [x["loss"] for x in lines(part)] == [x["loss"] for x in lines(whole)]
    for name, tensor in weights(whole).items():
        assert torch.equal(weights(part)[name], tensor), name


@pytest.mark.slow
def test_a_fault_that_recurs_after_every_rollback_stops_at_its_last_good_checkpoint(tmp_path):
    """Every sample from window 25 on is non-finite (its inputs NaN): every replay skips
    window after window again, whatever is set aside. After 3 rollbacks the guard stops the
    run where it was good, and the command says how to train through it."""
    from gradaccum.app.cli.train import guard_stop

    out = tmp_path / "nan"
    nan = corrupt_samples([(24 * BATCH, 10**9)], kind="scale", factor=float("nan"))
    summary = run(out, faults=nan, steps=60)
    assert summary["stopped_by"] == "guard"
    assert guard_stop(out) == (
        f"gradaccum: the incident guard stopped the run (see {out / 'incidents.jsonl'}); "
        f"to train through it: gradaccum train --resume {out} --no-guard"
    )
    incidents = lines(out, "incidents.jsonl")
    assert [i["retry"] for i in incidents] == [1, 2, 3, 3]
    assert {i["kind"] for i in incidents} == {"skipped windows"}
    assert incidents[-1]["action"].startswith("stopped: 3 rollbacks in a row")
    assert summary["incidents"] == 4
    # every skipped window counts, those rolled back too (the warnings said each)
    assert summary["skipped_windows"] == sum(i["seen"]["skipped_in_a_row"] for i in incidents)
    back = incidents[-1]["rolled_back_to"]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == back
    assert [x["step"] for x in lines(out)] == list(range(1, back + 1))

    # --no-guard on resume trains on past it (here without the faults: the data is clean again)
    cli("train", "--resume", out, "--no-guard", threads=1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "length" and lines(out)[-1]["step"] == 60
    assert json.loads((out / "resumes.jsonl").read_text())["changed"] == {"guard": [True, False]}


@pytest.mark.slow
def test_a_divergence_in_the_warm_up_stops_the_run_and_blames_no_data(tmp_path):
    """--lr 1e3 on digits: the loss leaps from chance level at once. The guard calls it a
    divergence from the first windows on, inside its warm-up, sets nothing aside, and the
    command says to lower --lr."""
    out = tmp_path / "run"
    args = ["--recipe", "digits", "--lr", "1000", "--steps", 30, "--effective-batch", 16]
    proc = cli("train", *args, "--micro-batch", 8, "--out", out, check=False, threads=1)
    assert proc.returncode == 1, proc.stderr[-2000:]
    [incident] = lines(out, "incidents.jsonl")
    assert incident["kind"] == "divergence" and incident["step"] <= 3, incident
    assert "nothing set aside" in incident["action"] and incident["rolled_back_to"] == 0
    assert "the loss diverged in the warm-up" in proc.stderr and "lower --lr" in proc.stderr
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["skips"] == [] and saved["step"] == 0  # back at the start, no data blamed


def _spoil(kept_step: int, how: str):
    """A fault hook that, as step 25's window begins, makes the kept checkpoint of
    ``kept_step`` a bad state with a valid checksum: its weights NaN, or buried in noise."""
    done = []

    def change(state):
        gen = torch.Generator().manual_seed(0)
        for tensor in state["accumulator"]["model"].values():
            if not tensor.is_floating_point():
                continue
            if how == "nan":
                tensor.fill_(float("nan"))
            else:  # finite, and nothing of what the run learned left
                tensor.add_(torch.randn(tensor.shape, generator=gen) * 3.0)

    def hook(out, position, batch, first):
        if position >= first and not done:
            done.append(1)
            rewrite_checkpoint(out / "checkpoints" / f"step-{kept_step:08d}.pt", change)
        return batch

    return hook


@pytest.mark.parametrize(
    "how, said",
    [
        ("noise", "scores its own last window"),
        pytest.param("nan", "holds non-finite weights", marks=pytest.mark.slow),
    ],
)
def test_a_rollback_target_in_a_bad_state_is_passed_over_for_an_older_one(tmp_path, how, said):
    """Step 25's window corrupted; the kept checkpoint of step 20, the rollback's target, was
    made a bad state (a valid checksum: nothing but judging it can tell). The guard passes
    it over, says so, rolls back to step 10, and the run ends as asked."""
    ends = [0]
    data = DigitsData(0)
    for _ in range(STEPS):
        ends.append(ends[-1] + len(data.batch(ends[-1], BATCH)[1]))
    corrupt = corrupt_samples([[ends[24], ends[25]]])
    spoil = _spoil(20, how)
    out = tmp_path / "run"
    summary = run(out, faults=lambda p, b: corrupt(p, spoil(out, p, b, ends[24])))
    [incident] = lines(out, "incidents.jsonl")
    assert incident["step"] == 25 and incident["rolled_back_to"] == 10, incident
    assert f"step 20 {said}" in incident["action"], incident["action"]
    assert summary["steps"] == STEPS and summary["stopped_by"] == "length"
    assert [x["step"] for x in lines(out)] == list(range(1, STEPS + 1))
