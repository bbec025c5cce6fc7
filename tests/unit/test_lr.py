"""gradaccum.app.lr: the learning rate of each window, against the schedule written out."""

import math
from types import SimpleNamespace

import pytest

from gradaccum.app.lr import LearningRate
from gradaccum.app.run import Progress
from gradaccum.schedule import BatchSchedule


def rate(step: int, *, warmup=4, total=20, lr=0.1, rule="none", size=32, start=32) -> float:
    schedule = BatchSchedule("constant", start=start, unit=8)
    schedule.step = step
    progress = Progress(schedule, total_steps=total, total_samples=None)
    cfg = SimpleNamespace(lr=lr, warmup_steps=warmup, lr_scaling=rule)
    return LearningRate(cfg, start, progress)(size)


def test_the_warm_up_rises_linearly_then_the_cosine_falls_to_a_tenth():
    assert rate(0) == pytest.approx(0.1 * 1 / 5)
    assert rate(3) == pytest.approx(0.1 * 4 / 5)
    assert rate(4) == pytest.approx(0.1)  # the warm-up's end: the cosine's top
    middle = 4 + (20 - 4) / 2
    assert rate(int(middle)) == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))))
    assert rate(20) == pytest.approx(0.01)
    assert rate(25) == pytest.approx(0.01)  # past the end it stays at a tenth


def test_a_window_of_another_size_scales_by_the_batch_rule():
    assert rate(4, rule="sqrt", size=128) == pytest.approx(0.1 * 2)
    assert rate(4, rule="linear", size=16) == pytest.approx(0.1 / 2)
    assert rate(4, rule="none", size=128) == pytest.approx(0.1)


def test_apply_writes_every_parameter_group():
    import torch

    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    schedule = BatchSchedule("constant", start=8, unit=8)
    cfg = SimpleNamespace(lr=0.3, warmup_steps=0, lr_scaling="none")
    lr = LearningRate(cfg, 8, Progress(schedule, 10, None)).apply(opt, 8)
    assert lr == pytest.approx(0.3)
    assert [g["lr"] for g in opt.param_groups] == [lr, lr]
