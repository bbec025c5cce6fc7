"""Batch-size schedules: their sizes, auto's rule, every window exact against its full batch,
and their state across a checkpoint."""

import copy
import math

import pytest
import torch
from helpers import (
    TASKS,
    capture_step_grads,
    make_model,
    max_rel_err,
    padded_lm_batch,
    reference_grads,
)

import gradaccum as ga
from gradaccum.schedule import BatchSchedule, lr_factor
from gradaccum.window import StepResult


def result(count: int, interval=None) -> StepResult:
    return StepResult(1.0, count, 1.0, True, None, 1, 1, noise_interval=interval)


def sizes(schedule: BatchSchedule, windows: int) -> list[int]:
    out = []
    for _ in range(windows):
        out.append(schedule.size())
        schedule.update(result(out[-1]), out[-1])
    return out


def test_fixed_schedules_in_whole_micro_batches():
    assert sizes(BatchSchedule("constant", start=24, unit=8), 3) == [24, 24, 24]
    assert sizes(BatchSchedule("steps:2=64,4=100", start=32, unit=16), 6) == [
        32,
        32,
        64,
        64,
        96,
        96,
    ]
    # samples: from 96 samples seen on (after three windows of 32)
    assert sizes(BatchSchedule("samples:96=64", start=32, unit=16), 5) == [32, 32, 32, 64, 64]
    ramp = sizes(BatchSchedule("linear:512=128", start=32, unit=16), 10)
    assert ramp[0] == 32 and ramp[-1] == 128 and ramp == sorted(ramp)
    assert all(b % 16 == 0 for b in ramp)
    schedule = BatchSchedule("linear:512=128", start=32, unit=16)
    sizes(schedule, 10)
    assert schedule.samples == sum(ramp) and schedule.step == 10


@pytest.mark.parametrize(
    "spec, why",
    [
        ("ramp", "expected constant, auto, steps:S=B"),
        ("steps:10", "'10' is not WHEN=BATCH"),
        ("steps:10=0", "'10=0' is not WHEN=BATCH"),
        ("samples:100=64,50=128", "increasing order"),
        ("linear:100=64,200=128", "linear takes one N=B"),
        ("auto:5", "auto takes no points"),
    ],
)
def test_bad_schedules_are_one_line_naming_the_spec(spec, why):
    with pytest.raises(ValueError, match=why) as err:
        BatchSchedule(spec, start=32, unit=8)
    assert "\n" not in str(err.value) and repr(spec) in str(err.value)
    with pytest.raises(ValueError, match="max_effective_batch 16 is below"):
        BatchSchedule("auto", start=32, unit=8, maximum=16)


def test_auto_grows_only_when_the_whole_interval_is_above_and_at_most_twice():
    schedule = BatchSchedule("auto", start=32, unit=8, maximum=200)
    # items per sample: 10 (a language model's tokens); B_simple is in items
    schedule.update(result(320, interval=(100.0, 5000.0)), 32)  # low = 10 samples < 32
    assert schedule.size() == 32
    schedule.update(result(320, interval=(2000.0, 5000.0)), 32)  # low = 200 samples
    assert schedule.size() == 64  # at most x2 per change
    schedule.update(result(640, interval=(900.0, 5000.0)), 64)  # low = 90 samples
    assert schedule.size() == 88  # the lower bound, in whole micro-batches (floor)
    for _ in range(5):
        schedule.update(result(880, interval=(10_000.0, 50_000.0)), 88)
    assert schedule.size() == 200  # the ceiling
    assert [b for _, b in schedule.changes] == [64, 88, 176, 200]
    schedule.update(result(2000, interval=(10.0, 20.0)), 200)
    assert schedule.size() == 200  # it never lowers the batch


def test_state_travels_and_refuses_another_schedule():
    a = BatchSchedule("auto", start=16, unit=8)
    a.update(result(160, interval=(400.0, 900.0)), 16)
    b = BatchSchedule("auto", start=16, unit=8)
    b.load_state_dict(a.state_dict())
    assert (b.size(), b.samples, b.step, b.changes) == (a.size(), a.samples, a.step, a.changes)
    with pytest.raises(ValueError, match="written under batch schedule 'auto'"):
        BatchSchedule("constant", start=16, unit=8).load_state_dict(a.state_dict())


def test_lr_rules():
    assert lr_factor("none", 256, 32) == 1
    assert lr_factor("linear", 256, 32) == 8
    assert lr_factor("sqrt", 256, 32) == pytest.approx(math.sqrt(8))
    with pytest.raises(ValueError, match="got 'cube'"):
        lr_factor("cube", 256, 32)


def train_with(
    schedule, model, make_batch, loss_fn, reference, windows, micro, noise=None, lr=0.05, every=1
):
    """The library loop of schedule.py's docstring; the gradient of every ``every``-th window
    (as the optimizer receives it) against its full batch's, computed by torch on a copy of
    the model."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer, noise=noise)
    errors, used = [], []
    for w in range(windows):
        size = schedule.size()
        batch = make_batch(seed=w, n=size)
        if w % every == 0:
            want = reference_grads(copy.deepcopy(model), batch, reference)
        result = acc.step(ga.split(batch, micro), loss_fn)
        schedule.update(result, size)
        if w % every == 0:
            errors.append(max_rel_err(seen[-1], want))
        used.append(size)
    return errors, used


def test_every_window_of_a_ramp_is_its_full_batch():
    """Padded sequences (a different token count in every micro-batch), a ramp from 4 to 16
    sequences in micro-batches of 4."""
    factory, _, loss_fn, reference = TASKS["lm"]
    schedule = BatchSchedule("linear:40=16", start=4, unit=4)
    errors, used = train_with(
        schedule, make_model(factory), padded_lm_batch, loss_fn, reference, 6, micro=4
    )
    assert used[0] == 4 and used[-1] == 16 and len(set(used)) >= 3, used
    assert max(errors) <= 1e-6, errors


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_every_window_of_auto_is_its_full_batch():
    """Linear regression near a fixed point (B_simple about 46 samples; a small learning
    rate) from a start of 16 samples in micro-batches of 4: auto grows once the interval's
    lower end passes the batch (a window of 16 is 3x below B_simple, where |G|^2 is hard to
    see, so that takes windows), and every 10th window is checked exact."""
    d = 10
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=g)
    delta = torch.randn(d, generator=g)
    delta = delta / delta.norm() * 0.8

    def make_batch(seed, n):
        gen = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(n, d, generator=gen)
        return x, x @ w_star + 1.5 * torch.randn(n, generator=gen)

    def loss_fn(model, mb):
        x, y = mb
        return ga.sample_mean(0.5 * (model(x).squeeze(1) - y) ** 2)

    def reference(model, batch):
        x, y = batch
        return (0.5 * (model(x).squeeze(1) - y) ** 2).mean()

    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    schedule = BatchSchedule("auto", start=16, unit=4, maximum=128)
    errors, used = train_with(
        schedule,
        model,
        make_batch,
        loss_fn,
        reference,
        300,
        micro=4,
        noise=ga.NoiseScale(),
        lr=1e-4,
        every=10,
    )
    print("auto batches:", schedule.changes)
    assert schedule.changes and used[-1] > 16, used
    assert len(set(used)) > 1 and len(errors) == 30
    assert max(errors) <= 1e-6, max(errors)


def test_the_text_stream_is_the_same_however_its_windows_are_cut():
    """The gpt recipe's data: sample i is a function of (seed, i) alone, across the blocks
    its random starts are drawn in, so a changing batch reads the same stream."""
    from gradaccum.app.recipes import get_recipe

    data = get_recipe("gpt").make_data(3)
    whole = data.batch(1000, 60)["input_ids"]  # crosses the block boundary at 1024
    cut = [data.batch(1000, 24)["input_ids"], data.batch(1024, 36)["input_ids"]]
    assert torch.equal(torch.cat(cut), whole)
    assert not torch.equal(get_recipe("gpt").make_data(4).batch(1000, 60)["input_ids"], whole)
