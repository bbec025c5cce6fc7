"""FrameworkWindow (gradaccum.integrations.window): the engine's end-of-window arithmetic for
a loop another framework runs, checked on a plain loop against the full batch."""

import pytest
import torch
from helpers import (
    MLP,
    UNEVEN_SIZES,
    make_model,
    max_rel_err,
    mlp_loss,
    mlp_reference,
    reference_grads,
    regression_batch,
    split_sizes,
)

import gradaccum as ga
from gradaccum.integrations.window import FrameworkWindow


def framework_loop(model, micro_batches, divided_by: float = 1.0, noise=None):
    """What a framework does: backward per micro-batch (its loss divided by
    ``divided_by``, as Lightning divides by N), the window told each count, then ``end``."""
    window = FrameworkWindow(model, noise)
    for mb in micro_batches:
        loss_sum, count = mlp_loss(model, mb)
        (loss_sum / divided_by).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        window.add(loss_sum, count, grads, 1 / divided_by)
    return window.end([p.grad for p in model.parameters()], carried=1 / divided_by)


@pytest.mark.parametrize("divided_by", [1.0, 4.0, 3.0])
def test_the_window_is_divided_once_into_the_full_batch_gradient(divided_by):
    batch = regression_batch(seed=3)
    want = reference_grads(make_model(MLP), batch, mlp_reference)
    model = make_model(MLP)
    end = framework_loop(model, split_sizes(batch, UNEVEN_SIZES[4]), divided_by)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert max_rel_err(got, want) <= 1e-6
    assert end.count == batch[0].shape[0] and end.finite
    assert end.grad_norm == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()]))),
        rel=1e-5,
    )


def test_noise_scale_is_the_accumulators_on_the_same_micro_batches():
    batches = [split_sizes(regression_batch(seed=s), UNEVEN_SIZES[4]) for s in range(8)]
    model = make_model(MLP)
    noise = ga.NoiseScale()
    for micro in batches:
        end = framework_loop(model, micro, divided_by=4.0, noise=noise)
        model.zero_grad(set_to_none=True)
    acc_model = make_model(MLP)
    acc = ga.Accumulator(
        acc_model, torch.optim.SGD(acc_model.parameters(), lr=0.0), noise=ga.NoiseScale()
    )
    for micro in batches:
        result = acc.step(micro, mlp_loss)
    # (13 items a window: |G|^2 is not clearly positive yet, so B_simple is None on both)
    assert noise.estimates() == pytest.approx(acc.noise.estimates(), rel=1e-6)
    assert noise.updates == acc.noise.updates == len(batches)
    assert end.b_simple == result.noise_scale


def test_a_window_of_no_items_leaves_the_gradient_alone():
    model = make_model(MLP)
    x, y = regression_batch(seed=0)
    window = FrameworkWindow(model, ga.NoiseScale())
    (model(x).sum() * 0.0).backward()
    window.add(model(x).sum() * 0.0, 0)
    end = window.end([p.grad for p in model.parameters()])
    assert end.count == 0 and end.loss is None and end.grad_norm is None


def test_a_bad_count_names_the_micro_batch():
    model = make_model(MLP)
    window = FrameworkWindow(model, None)
    x, _ = regression_batch(seed=0)
    window.add(model(x).sum(), 3)
    with pytest.raises(ValueError, match="got -1 from micro-batch 1"):
        window.add(model(x).sum(), -1)


def test_a_dropped_window_forgets_its_counts_and_noise_prefixes():
    """What a replay after out-of-memory does: the micro-batches before the drop count for
    nothing, those after make the whole window's gradient and the same noise reading."""
    batch = regression_batch(seed=5)
    want = reference_grads(make_model(MLP), batch, mlp_reference)
    clean_noise = ga.NoiseScale()
    framework_loop(make_model(MLP), split_sizes(batch, UNEVEN_SIZES[4]), noise=clean_noise)
    model, noise = make_model(MLP), ga.NoiseScale()
    window = FrameworkWindow(model, noise)
    for mb in split_sizes(batch, UNEVEN_SIZES[4])[:2]:  # the attempt that ran out of memory
        loss_sum, count = mlp_loss(model, mb)
        loss_sum.backward()
        window.add(loss_sum, count, [p.grad for p in model.parameters()])
    window.drop()
    for p in model.parameters():
        p.grad = None
    for mb in split_sizes(batch, UNEVEN_SIZES[4]):
        loss_sum, count = mlp_loss(model, mb)
        loss_sum.backward()
        window.add(loss_sum, count, [p.grad for p in model.parameters()])
    end = window.end([p.grad for p in model.parameters()])
    assert end.count == len(batch[0])
    assert max_rel_err({n: p.grad for n, p in model.named_parameters()}, want) <= 1e-6
    assert noise.state_dict() == clean_noise.state_dict()


def test_scheduled_windows_step_after_the_schedules_window_whatever_came_before():
    """N is the epoch's count at the window's end: a framework that steps at multiples of N
    steps there, and at no multiple before it."""
    from gradaccum.integrations.window import ScheduledWindows

    windows = ScheduledWindows(ga.BatchSchedule("steps:1=24", start=8, unit=4), micro_size=4)
    assert windows.smallest() == 2
    done = 0
    for want in (2, 6, 6):
        n, length = windows.next_window(done)
        assert length == want and n == done + length
        assert [k for k in range(done + 1, done + length + 1) if k % n == 0] == [done + length]
        done += length
        windows.schedule.update(
            type("End", (), {"count": 4 * length, "noise_interval": None}), 4 * length
        )


@pytest.mark.parametrize(
    ("schedule", "micro_size", "world", "message"),
    [
        (ga.BatchSchedule("constant", start=8, unit=2), 4, 1, "unit \\(2\\) must be a multiple"),
        (ga.BatchSchedule("constant", start=6, unit=4), 4, 1, "start \\(6\\) must be a multiple"),
        (ga.BatchSchedule("constant", start=8, unit=8), 4, 4, "4 x 4"),
    ],
)
def test_scheduled_windows_refuse_a_batch_that_is_not_whole_micro_batches(
    schedule, micro_size, world, message
):
    from gradaccum.integrations.window import ScheduledWindows

    with pytest.raises(ValueError, match=message):
        ScheduledWindows(schedule, micro_size, world)


def test_scheduled_windows_old_micro_name_is_gone_in_0_8():
    """``micro=`` and ``.micro`` were the names of ``micro_size`` in 0.7, kept with a warning
    until 0.8: gone now, a TypeError and an AttributeError that name them."""
    from gradaccum.integrations.window import ScheduledWindows

    schedule = ga.BatchSchedule("steps:1=24", start=8, unit=4)
    with pytest.raises(TypeError, match="micro"):
        ScheduledWindows(schedule, micro=4)
    new = ScheduledWindows(schedule, micro_size=4)
    assert new.next_window(0) == (2, 2)
    with pytest.raises(AttributeError, match="micro"):
        new.micro  # noqa: B018 (the access is the test)
