"""Mixed precision inside the window: fp32 buffers, bf16 autocast, fp16 + GradScaler."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    MLP,
    TASKS,
    UNEVEN_SIZES,
    capture_step_grads,
    make_model,
    max_rel_err,
    params,
    split_sizes,
)

import gradaccum as ga

N_MICRO = 32


def bf16_mlp():
    return make_model(lambda: MLP(d_in=16, hidden=64, d_out=4)).to(torch.bfloat16)


def regression_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * N_MICRO, 16, generator=g)
    return x, torch.randn(4 * N_MICRO, 4, generator=g) + 1.0


def bf16_loss(model, mb):
    x, y = mb
    pred = model(x.to(torch.bfloat16)).float()
    return ga.sample_mean(F.mse_loss(pred, y, reduction="none"))


def exact_sum_of_micro_gradients(micro):
    """fp64 sum of each micro-batch's own bf16 gradient: what accumulation should produce."""
    model = bf16_mlp()
    total = {}
    for mb in micro:
        model.zero_grad(set_to_none=True)
        bf16_loss(model, mb)[0].backward()
        for n, p in model.named_parameters():
            total[n] = total.get(n, 0) + p.grad.double()
    return total


def accumulate(micro, accumulate_dtype):
    model = bf16_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handed = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(
        model, optimizer, precision=ga.Precision(accumulate_dtype=accumulate_dtype)
    )
    for mb in micro:
        with acc.micro_batch():
            acc.backward(*bf16_loss(model, mb))
    summed = {k: v.clone() for k, v in acc.accumulated_gradient().items()}
    result = acc.end_window()
    assert result.stepped
    return summed, handed[0]


def test_fp32_buffers_keep_a_32_micro_batch_bf16_window_exact():
    x, y = regression_data()
    micro = ga.split((x, y), 4)
    assert len(micro) == N_MICRO
    exact = exact_sum_of_micro_gradients(micro)
    exact_mean = {k: v / len(x) for k, v in exact.items()}
    full64 = bf16_mlp().double()
    F.mse_loss(full64(x.double()), y.double()).backward()
    full = {n: p.grad for n, p in full64.named_parameters()}

    buf_sum, buf_handed = accumulate(micro, torch.float32)
    plain_sum, plain_handed = accumulate(micro, None)
    assert all(v.dtype == torch.float32 for v in buf_sum.values())
    assert all(v.dtype == torch.bfloat16 for v in plain_sum.values())

    errors = {
        "accumulation, fp32 buffers": max_rel_err(buf_sum, exact),
        "accumulation, bf16 .grad": max_rel_err(plain_sum, exact),
        "handed to optimizer, fp32 buffers": max_rel_err(buf_handed, exact_mean),
        "handed to optimizer, bf16 .grad": max_rel_err(plain_handed, exact_mean),
        "vs fp64 full batch, fp32 buffers": max_rel_err(buf_handed, full),
        "vs fp64 full batch, bf16 .grad": max_rel_err(plain_handed, full),
    }
    for name, err in errors.items():
        print(f"{name:36s} {err:.2e}")
    assert errors["accumulation, fp32 buffers"] <= 1e-5
    assert errors["accumulation, bf16 .grad"] >= 100 * max(
        errors["accumulation, fp32 buffers"], 1e-9
    )
    # one final rounding to bf16 beats 32 of them
    assert errors["handed to optimizer, fp32 buffers"] < errors["handed to optimizer, bf16 .grad"]


def test_accumulate_dtype_defaults_follow_the_parameters():
    fp32 = make_model(MLP)
    assert (
        ga.Accumulator(fp32, torch.optim.SGD(fp32.parameters(), lr=0.1)).precision.accumulate_dtype
        is None
    )
    bf16 = bf16_mlp()
    acc = ga.Accumulator(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1))
    assert acc.precision.accumulate_dtype == torch.float32
    acc = ga.Accumulator(
        bf16,
        torch.optim.SGD(bf16.parameters(), lr=0.1),
        precision=ga.Precision(accumulate_dtype=None),
    )
    assert acc.precision.accumulate_dtype is None


def test_buffers_are_dropped_with_a_skipped_window():
    x, y = regression_data()
    micro = ga.split((x, y), 16)
    model = bf16_mlp()
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = params(model)

    def poisoned(model, mb):
        loss_sum, count = bf16_loss(model, mb)
        return loss_sum * float("nan"), count

    assert acc.step(micro, poisoned).skipped == "non-finite gradient"
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    reference = bf16_mlp()
    ga.Accumulator(reference, torch.optim.SGD(reference.parameters(), lr=0.1)).step(
        micro, bf16_loss
    )
    acc.step(micro, bf16_loss)
    assert all(torch.equal(p, params(reference)[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_bf16_autocast_window_matches_full_batch_under_autocast(task):
    factory, make_batch, loss_fn, reference = TASKS[task]
    batch = make_batch(seed=1)
    model = make_model(factory)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = reference(model, batch)
    loss.backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = make_model(factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer, precision="bf16")
    result = acc.step(split_sizes(batch, UNEVEN_SIZES[7]), loss_fn)
    assert result.stepped
    # bf16's tolerance (torch.testing's rtol for bfloat16), on each tensor's norm: single
    # elements near zero differ by more, because micro-batches round activations differently.
    err = max_rel_err(seen[0], full)
    print(f"{task}: bf16 autocast accumulated vs full batch {err:.2e}")
    assert err <= 1.6e-2


def fp16_setup(init_scale=2.0**10, sgd=False, precision="fp16"):
    factory, _, loss_fn, _ = TASKS["lm"]
    model = make_model(factory)
    if sgd:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if precision == "fp16" else None
    acc = ga.Accumulator(
        model, optimizer, scheduler=scheduler, precision=ga.Precision(precision, scaler=scaler)
    )
    return model, optimizer, scheduler, acc


def lm_windows():
    _, make_batch, _, _ = TASKS["lm"]
    return [split_sizes(make_batch(seed=20 + i), UNEVEN_SIZES[4]) for i in range(3)]


def poison_last(loss_fn):
    def poisoned(model, mb):
        loss_sum, count = loss_fn(model, mb)
        if mb["input_ids"].shape[0] == 4:  # the window's last micro-batch
            loss_sum = loss_sum * float("inf")
        return loss_sum, count

    return poisoned


def test_fp16_overflow_skips_the_window_and_lowers_the_scale():
    _, _, loss_fn, _ = TASKS["lm"]
    wins = lm_windows()
    model, optimizer, scheduler, acc = fp16_setup()
    assert acc.step(wins[0], loss_fn).stepped
    before = params(model)
    opt_before = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    scale, epoch = acc.precision.scaler.get_scale(), scheduler.last_epoch

    result = acc.step(wins[1], poison_last(loss_fn))

    assert result.skipped == "fp16 overflow" and not result.stepped
    assert acc.precision.scaler.get_scale() == scale * 0.5
    assert scheduler.last_epoch == epoch
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt_after = optimizer.state_dict()["state"][0]
    assert all(torch.equal(opt_after[k], v) for k, v in opt_before.items())
    assert acc.step(wins[2], loss_fn).stepped and acc.state.optimizer_steps == 2


def test_fp16_normal_windows_match_fp32():
    factory, _, loss_fn, _ = TASKS["lm"]
    wins = lm_windows()
    # SGD: its update is proportional to the gradient, so parameters inherit the gradient's
    # error. (Adam divides by |g|, so elements near zero move by a full lr on the sign of
    # rounding noise in any two precisions; comparing its parameters would test Adam.)
    model, optimizer, _, acc = fp16_setup(sgd=True)
    seen16 = capture_step_grads(optimizer, model)
    for w in (wins[0], wins[2]):
        assert acc.step(w, loss_fn).stepped
    ref, ref_opt, _, ref_acc = fp16_setup(sgd=True, precision="fp32")
    seen32 = capture_step_grads(ref_opt, ref)
    ref_acc.step(wins[0], loss_fn)
    ref_acc.step(wins[2], loss_fn)
    # fp16 keeps 11 significant bits (unit roundoff 4.9e-4); a forward and backward through
    # a few fp16 matmuls compounds several of them: 10 units is fp16's tolerance here.
    grad_errs = [max_rel_err(a, b) for a, b in zip(seen16, seen32, strict=True)]
    param_err = max_rel_err(params(model), params(ref))
    print(f"fp16 vs fp32: gradient errors {grad_errs}, parameters {param_err:.2e}")
    assert len(grad_errs) == 2 and max(grad_errs) <= 5e-3
    assert param_err <= 5e-3
    assert max_rel_err(params(model), params(make_model(factory))) > 1e-2  # they did train


def test_the_count_prescale_keeps_the_default_scale_from_overflowing():
    """A summed loss has count-times larger gradients than a mean; without the power-of-two
    pre-scale, GradScaler's default 65536 overflows this LM's first window."""
    _, _, loss_fn, _ = TASKS["lm"]
    _, _, _, acc = fp16_setup(init_scale=2.0**16)
    assert acc.step(lm_windows()[0], loss_fn).stepped


def test_resume_restores_the_loss_scale_exactly(tmp_path):
    _, _, loss_fn, _ = TASKS["lm"]
    wins = lm_windows()
    model, _, _, acc = fp16_setup()
    acc.step(wins[0], loss_fn)
    acc.step(wins[1], poison_last(loss_fn))  # scale now differs from the default
    saved_scale = acc.precision.scaler.get_scale()
    torch.save(acc.state_dict(), tmp_path / "ckpt.pt")
    acc.step(wins[2], loss_fn)

    resumed_model, _, _, resumed = fp16_setup(init_scale=2.0**16)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert resumed.precision.scaler.get_scale() == saved_scale != 2.0**16
    assert resumed.precision.scaler.state_dict() == torch.load(tmp_path / "ckpt.pt")["scaler"]
    resumed.step(wins[2], loss_fn)
    assert all(torch.equal(p, params(model)[n]) for n, p in resumed_model.named_parameters())
    assert resumed.precision.scaler.get_scale() == acc.precision.scaler.get_scale()


def test_precision_arguments_are_checked():
    model = make_model(MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"
    ):
        ga.Accumulator(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="accumulate_dtype must be .* got torch.int32"):
        ga.Accumulator(model, opt, precision=ga.Precision(accumulate_dtype=torch.int32))
    with pytest.raises(ValueError, match="accumulate_dtype=torch.float64 does not apply"):
        ga.Accumulator(model, opt, precision=ga.Precision("fp16", accumulate_dtype=torch.float64))
    with pytest.raises(ValueError, match="GradScaler was given but precision is 'bf16'"):
        ga.Accumulator(
            model, opt, precision=ga.Precision("bf16", scaler=torch.amp.GradScaler("cpu"))
        )
    half = make_model(MLP).half()
    with pytest.raises(ValueError, match="precision='fp16' needs fp32 parameters"):
        ga.Accumulator(half, torch.optim.SGD(half.parameters(), lr=0.1), precision="fp16")
    with pytest.raises(
        ValueError, match="checkpoint has no scaler state but this Accumulator has one"
    ):
        ga.Accumulator(model, opt, precision="fp16").load_state_dict(
            ga.Accumulator(model, opt).state_dict()
        )


def test_fp64_buffers_are_allowed_and_used():
    x, y = regression_data()
    model = make_model(lambda: MLP(d_in=16, hidden=64, d_out=4))
    acc = ga.Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision=ga.Precision(accumulate_dtype=torch.float64),
    )

    def loss_fn(model, mb):
        xx, yy = mb
        return ga.sample_mean(F.mse_loss(model(xx), yy, reduction="none"))

    with acc.micro_batch():
        acc.backward(*loss_fn(model, (x, y)))
    assert all(g.dtype == torch.float64 for g in acc.accumulated_gradient().values())
    assert math.isfinite(acc.end_window().loss)


def test_a_precision_object_serves_one_accumulator():
    model = make_model(MLP)
    precision = ga.Precision("bf16")
    ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    with pytest.raises(ValueError, match="already serves an Accumulator; give each its own"):
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    with pytest.raises(TypeError, match=r"oom must be OOMReplay\(...\) or None, got True"):
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), oom=True)
