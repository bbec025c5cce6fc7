"""The window's arithmetic (gradaccum.window): the end against torch's own clip_grad_norm_,
and one tally behind the Accumulator, the framework window and the pipeline window."""

import math

import pytest
import torch
from helpers import (
    TinyLM,
    capture_step_grads,
    lm_reference,
    make_model,
    max_rel_err,
    padded_lm_batch,
    reference_grads,
    split_sizes,
)

import gradaccum as ga
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


# -- one tally on every path -------------------------------------------------------------------


def window_gradient(model) -> dict[str, torch.Tensor]:
    """The gradient the optimizer steps on: SGD at lr 1 moves each weight by exactly it."""
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_accumulator_the_framework_window_and_the_pipeline_window_share_one_tally(
    one_process_group,
):
    """Padded sequences in 4 micro-batches of 4, 3, 3 and 3 (how the pipeline's schedule cuts
    13): every micro-batch holds a different number of tokens. All three paths must give the
    full batch's mean gradient, which torch alone computes here."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.integrations.window import FrameworkWindow
    from gradaccum.pipeline import PipelineWindow

    batch = padded_lm_batch(seed=5)
    parts = split_sizes(batch, [4, 3, 3, 3])
    assert len({int((mb["labels"][:, 1:] != -100).sum()) for mb in parts}) == 4
    want = reference_grads(make_model(TinyLM), batch, lm_reference)

    def causal(out, labels):
        return ga.causal_lm_loss(out, labels)

    got = {}
    # The Accumulator, its step() (the gradient captured before the optimizer's step).
    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = ga.Accumulator(model, opt)
    captured = capture_step_grads(opt, model)
    acc.step(parts, lambda m, mb: causal(m(mb["input_ids"]), mb["labels"]))
    got["accumulator"] = captured[0]
    # A framework's loop: backward on each summed loss, the window told, then end().
    model = make_model(TinyLM)
    window = FrameworkWindow(model, None)
    for mb in parts:
        loss_sum, count = causal(model(mb["input_ids"]), mb["labels"])
        loss_sum.backward()
        window.add(loss_sum, count)
    end = window.end([p.grad for p in model.parameters()])
    got["framework"] = window_gradient(model)
    # A pipeline of one stage: the schedule cuts the batch itself.
    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture_step_grads(opt, model)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    pipe = PipelineWindow(stage, opt, causal, 4, schedule="gpipe")
    result = pipe.step(batch["input_ids"], target=batch["labels"])
    got["pipeline"] = captured[0]

    tokens = int((batch["labels"][:, 1:] != -100).sum())
    assert end.count == result.count == tokens
    for path, grads in got.items():
        assert max_rel_err(grads, want) <= 1e-5, path
