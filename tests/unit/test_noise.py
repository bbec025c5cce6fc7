"""The gradient noise scale against its closed form, and that it changes nothing else."""

import math

import pytest
import torch
from helpers import make_model, params
from torch import nn

import gradaccum as ga


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
