"""The end-of-window arithmetic (gradaccum.window) against torch's own clip_grad_norm_."""

import math

import pytest
import torch

from gradaccum.window import finish, total_norm


def gradients(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(5, 3, generator=g),
        torch.randn(7, generator=g),
        torch.randn(1, generator=g),
    ]


def test_one_division_then_torch_clipping_rule():
    divisor = 12.0
    for max_norm in (None, 1e9, 0.05):
        grads = gradients()
        # torch alone: divide, measure, clip (clip_grad_norm_ on parameters holding the mean)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g / divisor
        expected_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf))
        grad_norm, finite = finish(grads, divisor, max_norm)
        assert finite
        assert grad_norm == pytest.approx(expected_norm, rel=1e-6)
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)
    assert float(total_norm(grads)) < 0.05 * 1.0001  # clipped to the limit


def test_a_non_finite_gradient_is_reported_and_left_alone():
    grads = gradients()
    grads[1][3] = float("nan")
    before = [g.clone() for g in grads]
    grad_norm, finite = finish(grads, 4.0, max_grad_norm=1.0)
    assert not finite and math.isnan(grad_norm)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.nan_to_num(7.0), b.nan_to_num(7.0))  # not divided, not clipped


def test_total_norm_widens_low_precision_and_mixes_dtypes():
    exact = [torch.full((1000,), 0.01, dtype=torch.float64), torch.full((3,), 2.0)]
    expected = math.sqrt(1000 * 0.01**2 + 3 * 4.0)
    mixed = [exact[0].to(torch.bfloat16), exact[1]]
    assert float(total_norm(exact)) == pytest.approx(expected, rel=1e-7)  # fp32 part: fp32
    # bf16 holds 0.01 to 3 digits; the sum of its squares must not be rounded to bf16 too
    bf16_value = float(torch.tensor(0.01, dtype=torch.bfloat16))
    assert float(total_norm(mixed)) == pytest.approx(
        math.sqrt(1000 * bf16_value**2 + 12.0), rel=1e-6
    )
    assert float(total_norm([])) == 0.0
