"""A run resumed at a window boundary is the same run, bit for bit."""

import random

import numpy as np
import pytest
import torch
from helpers import TASKS, TinyLM, make_model, padded_lm_batch, params

import gradaccum as ga

_, _, LM_LOSS, _ = TASKS["lm"]
DATA = [padded_lm_batch(seed=100 + i) for i in range(6)]


def lm_loss_with_host_randomness(model, mb):
    # Dropout draws from torch's generator; this draws from Python's and NumPy's too, so
    # the test fails if any of the three is not restored.
    loss_sum, count = LM_LOSS(model, mb)
    jitter = 1.0 + 1e-3 * (random.random() + float(np.random.rand()))
    return loss_sum * jitter, count


def build(init_seed):
    model = make_model(lambda: TinyLM(dropout=0.2), init_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, ga.Accumulator(model, optimizer, scheduler=scheduler, max_grad_norm=0.5)


def train(acc, batches):
    return [acc.step(ga.split(b, 3), lm_loss_with_host_randomness) for b in batches]


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_is_bitwise_equal_to_a_straight_run(tmp_path):
    seed_all(0)
    straight_model, straight = build(init_seed=0)
    straight_results = train(straight, DATA)

    seed_all(0)
    _, first = build(init_seed=0)
    train(first, DATA[:3])
    path = tmp_path / "window3.pt"
    torch.save(first.state_dict(), path)
    del first

    seed_all(12345)  # a new process would start elsewhere; so does this one
    resumed_model, resumed = build(init_seed=99)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    resumed_results = train(resumed, DATA[3:])

    straight_params, resumed_params = params(straight_model), params(resumed_model)
    assert all(torch.equal(straight_params[k], resumed_params[k]) for k in straight_params)
    assert resumed.state == straight.state
    assert resumed.state.optimizer_steps == 6
    assert [r.loss for r in resumed_results] == [r.loss for r in straight_results[3:]]
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


def test_without_the_random_state_the_runs_diverge(tmp_path):
    """The guard for the test above: dropout makes the RNG matter, so skipping its restore
    must show up as a difference."""
    seed_all(0)
    straight_model, straight = build(init_seed=0)
    train(straight, DATA[:4])

    seed_all(0)
    _, first = build(init_seed=0)
    train(first, DATA[:3])
    checkpoint = first.state_dict()
    model, acc = build(init_seed=99)
    acc.load_state_dict(checkpoint)
    seed_all(12345)  # throw the restored generators away
    train(acc, DATA[3:4])
    a, b = params(straight_model), params(model)
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_a_foreign_or_mismatched_checkpoint_is_refused(tmp_path):
    model, acc = build(init_seed=0)
    with pytest.raises(ValueError, match="not a gradaccum Accumulator checkpoint"):
        acc.load_state_dict(model.state_dict())
    sd = acc.state_dict()
    del sd["rng"]
    with pytest.raises(ValueError, match="checkpoint is missing rng"):
        acc.load_state_dict(sd)
    other = make_model(lambda: TinyLM(d=8), 0)
    other_acc = ga.Accumulator(
        other,
        torch.optim.AdamW(other.parameters()),
        scheduler=torch.optim.lr_scheduler.LambdaLR(
            torch.optim.AdamW(other.parameters()), lambda s: 1.0
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"tok.weight is \(32, 16\), the model's \(32, 8\);.* \(27 tensors in all\)",
    ):
        other_acc.load_state_dict(acc.state_dict())
    no_sched = ga.Accumulator(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(
        ValueError, match="checkpoint has scheduler state but this Accumulator has none"
    ):
        no_sched.load_state_dict(acc.state_dict())


def _draws():
    return (torch.rand(3), random.random(), float(np.random.rand()))


def _lm_planning_setup(device):
    model = make_model(lambda: TinyLM(dropout=0.3), 0).to(device)
    batch = {k: v.to(device) for k, v in padded_lm_batch(seed=9, n=8).items()}
    return model, torch.optim.AdamW(model.parameters()), batch


@pytest.mark.parametrize("what", ["plan", "check"])
def test_plan_and_check_leave_every_host_generator_as_it_was(what):
    """Dropout in their training steps draws from torch's generator; loss_fn here also draws
    from Python's and NumPy's. Afterwards all three give the draws they would have given."""
    model, optimizer, batch = _lm_planning_setup("cpu")
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = _draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    if what == "plan":
        ga.plan(
            model, optimizer, batch, lm_loss_with_host_randomness, effective_batch=8, budget="4GiB"
        )
    else:
        ga.check(model, batch, lm_loss_with_host_randomness, micro_size=4, tolerance=1e-2)
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CUDA generator")
@pytest.mark.parametrize("what", ["plan", "check"])
def test_plan_and_check_leave_the_cuda_generator_untouched(what):
    model, optimizer, batch = _lm_planning_setup("cuda")
    before = torch.cuda.get_rng_state_all()
    if what == "plan":
        ga.plan(model, optimizer, batch, LM_LOSS, effective_batch=8, budget="4GiB", meter="tensors")
    else:
        ga.check(model, batch, LM_LOSS, micro_size=4, tolerance=1e-2)
    after = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_states_digest_survives_a_save_and_load_and_changes_with_one_bit(tmp_path):
    from support.faults import flip_tensor_bit

    from gradaccum.checkpoint import state_digest

    model, acc = build(0)
    acc.step(ga.split(DATA[0], 4), lm_loss_with_host_randomness)
    state = {"step": 1, "accumulator": acc.state_dict(), "names": ["a", "b"], "none": None}
    torch.save(state, tmp_path / "c.pt")
    again = torch.load(tmp_path / "c.pt", weights_only=True)
    assert state_digest(again) == state_digest(state)
    assert state_digest(dict(reversed(list(state.items())))) == state_digest(state)
    assert state_digest({**state, "step": 2}) != state_digest(state)
    assert state_digest({**state, "step": 1.0}) != state_digest(state)  # types count too

    flip_tensor_bit(tmp_path / "c.pt", record=3, byte=5, bit=2)
    damaged = torch.load(tmp_path / "c.pt", weights_only=True)  # it loads: nothing else tells
    assert state_digest(damaged) != state_digest(state)
