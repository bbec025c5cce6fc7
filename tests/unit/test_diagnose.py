"""The equivalence audit, BatchNorm handling and the gradient noise scale."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_model, params
from torch import nn

import gradaccum as ga
from gradaccum.diagnose import batchnorm_modules


class CNN(nn.Module):
    def __init__(self, norm: str = "batch") -> None:
        super().__init__()

        def norm_layer(c):
            return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(4, c)

        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            norm_layer(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2),
            norm_layer(8),
            nn.ReLU(),
        )
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.drop(self.features(x).flatten(1)))


def images():
    g = torch.Generator().manual_seed(0)
    return torch.randn(24, 1, 8, 8, generator=g), torch.randint(0, 10, (24,), generator=g)


def cnn_loss(model, mb):
    x, y = mb
    return ga.sample_mean(F.cross_entropy(model(x), y, reduction="none"))


def test_check_flags_batchnorm_by_name_and_passes_groupnorm():
    bn = make_model(CNN)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    report = ga.check(bn, images(), cnn_loss, micro_size=6)
    print(report.summary())
    assert not report.passed and report.max_error > 1e-2
    assert [(n, k) for n, k, _ in report.culprits] == [
        ("features.1", "BatchNorm2d"),
        ("features.4", "BatchNorm2d"),
    ]
    assert "FAIL" in report.summary() and "features.1 (BatchNorm2d)" in report.summary()
    # the audit leaves the model as it was: running statistics, modes, parameters
    assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())
    assert bn.training and bn.drop.training

    gn = make_model(lambda: CNN(norm="group"))
    report = ga.check(gn, images(), cnn_loss, micro_size=6)
    print(report.summary())
    assert report.passed and report.max_error <= 1e-5 and report.culprits == []
    assert report.dropout_disabled == 1


@pytest.mark.parametrize("to", ["groupnorm", "layernorm", "frozen"])
def test_convert_batchnorm_makes_the_audit_pass(to):
    model = make_model(CNN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ga.convert_batchnorm(model, to=to)
    assert names == ["features.1", "features.4"] and batchnorm_modules(model) == []
    report = ga.check(model, images(), cnn_loss, micro_size=6)
    assert report.passed, report.summary()
    # the optimizer built before the conversion still holds the affine parameters
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all(id(p) in held for p in model.parameters())


def test_check_finds_an_unlisted_module_that_mixes_samples():
    class BatchCentered(nn.Module):  # subtracts the batch mean: depends on the batch
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    model = make_model(
        lambda: nn.Sequential(nn.Linear(4, 8), BatchCentered(), nn.Tanh(), nn.Linear(8, 1))
    )
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))

    def loss_fn(model, mb):
        x, y = mb
        return ga.sample_mean(F.mse_loss(model(x), y, reduction="none"))

    report = ga.check(model, batch, loss_fn, micro_size=4)
    assert not report.passed
    assert [(n, k) for n, k, _ in report.culprits] == [("1", "BatchCentered")]


def test_accumulator_warns_once_about_batchnorm_in_train_mode(caplog):
    model = make_model(CNN)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        acc.step(ga.split(images(), 8), cnn_loss)
    warnings = [
        r for r in caplog.records if "BatchNorm" in r.getMessage() or "features.1" in r.getMessage()
    ]
    assert len(warnings) == 1 and "convert_batchnorm" in warnings[0].getMessage()


def test_momentum_correction_matches_one_full_batch_update():
    """Known statistics: features drawn from N(3, 2^2). After one window of 8 micro-batches
    the running mean and variance match one full-batch update within 2%."""
    g = torch.Generator().manual_seed(0)
    data = 3.0 + 2.0 * torch.randn(8 * 512, 16, generator=g)

    def fresh():
        bn = nn.BatchNorm1d(16, momentum=0.1)
        with torch.no_grad():
            bn.running_mean.fill_(0.0)
            bn.running_var.fill_(1.0)
        return bn

    full = fresh()
    full(data)
    corrected, plain = fresh(), fresh()
    with ga.batchnorm_momentum(corrected, micro_batches=8) as names:
        assert names == [""]
        assert corrected.momentum == pytest.approx(1 - 0.9 ** (1 / 8))
        for part in data.split(512):
            corrected(part)
    assert corrected.momentum == 0.1  # restored
    for part in data.split(512):
        plain(part)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # and the full update itself is what the formula says: 0.9 * start + 0.1 * batch stats
    assert rel(full.running_mean, 0.1 * data.mean(0)) < 1e-5
    for stat in ("running_mean", "running_var"):
        err = rel(getattr(corrected, stat), getattr(full, stat))
        wrong = rel(getattr(plain, stat), getattr(full, stat))
        print(f"{stat}: corrected {err:.2%}, uncorrected {wrong:.0%}")
        assert err <= 0.02 and wrong > 0.5


def test_noise_scale_matches_the_closed_form_on_linear_regression():
    """y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2), per-sample loss (x.w - y)^2 / 2 at
    w = w* + delta. Per-sample gradient g = x x^T delta - x eps: G = delta and, by Isserlis'
    theorem, tr(Sigma) = (d + 1)|delta|^2 + d s^2, so B_simple = d + 1 + d s^2 / |delta|^2."""
    d, s, delta_norm = 10, 1.5, 0.8
    analytic = d + 1 + d * s**2 / delta_norm**2
    torch.manual_seed(0)
    w_star = torch.randn(d)
    delta = torch.randn(d)
    delta = delta / delta.norm() * delta_norm
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    acc = ga.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), noise=ga.NoiseScale(ema=0.99)
    )  # lr 0: the same point, so the estimates can settle

    def loss_fn(model, mb):
        x, y = mb
        return ga.sample_mean(0.5 * (model(x).squeeze(1) - y) ** 2)

    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        x = torch.randn(128, d, generator=g)
        y = x @ w_star + s * torch.randn(128, generator=g)
        result = acc.step(ga.split((x, y), 16), loss_fn)
    print(f"B_simple estimated {result.noise_scale:.1f}, analytic {analytic:.1f}")
    assert result.noise_scale == pytest.approx(analytic, rel=0.15)
    g2, trace = acc.noise.estimates()
    assert g2 == pytest.approx(delta_norm**2, rel=0.15)


def test_noise_scale_changes_nothing_else_and_is_off_by_default(tmp_path):
    from helpers import TASKS, UNEVEN_SIZES, split_sizes

    factory, make_batch, loss_fn, _ = TASKS["lm"]
    runs = {}
    for on in (False, True):
        model = make_model(factory)
        acc = ga.Accumulator(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            noise=ga.NoiseScale() if on else None,
        )
        results = [
            acc.step(split_sizes(make_batch(seed=i), UNEVEN_SIZES[4]), loss_fn) for i in range(4)
        ]
        runs[on] = (params(model), results, acc)
    assert all(torch.equal(runs[False][0][k], runs[True][0][k]) for k in runs[False][0])
    assert all(r.noise_scale is None for r in runs[False][1])
    assert runs[False][2].noise is None
    # (early windows may leave |G|^2 estimated <= 0, where B_simple is undefined: None)
    last = runs[True][1][-1].noise_scale
    assert last is not None and math.isfinite(last) and last > 0
    # and it travels with checkpoints
    torch.save(runs[True][2].state_dict(), tmp_path / "c.pt")
    model = make_model(factory)
    again = ga.Accumulator(model, torch.optim.AdamW(model.parameters()), noise=ga.NoiseScale())
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert again.noise.value() == runs[True][2].noise.value()


def test_advice_in_plain_words():
    from gradaccum.noise import advice

    assert "8x the estimated critical batch" in advice(800, 100.0)
    assert "not estimated yet" in advice(800, None)
    assert "estimated |G|^2 is not positive" in advice(800, None, estimated=True)
    assert "smaller batches would need fewer samples" in advice(800, 100.0)
    assert "larger batches" in advice(10, 100.0)
    assert "not estimated yet" in advice(10, None)
