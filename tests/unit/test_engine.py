"""Window boundaries, clipping, scheduler, the non-finite guard and the manual mode."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    MLP,
    TASKS,
    UNEVEN_SIZES,
    TinyLM,
    capture_step_grads,
    make_model,
    max_rel_err,
    mlp_loss,
    padded_lm_batch,
    params,
    reference_grads,
    regression_batch,
    split_sizes,
)

import gradaccum as ga


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def optimizer_tensors(optimizer) -> dict:
    out = {}
    for i, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def test_manual_mode_parameters_change_only_at_window_end():
    model = make_model(MLP)
    batch = regression_batch(seed=5)
    expected = reference_grads(make_model(MLP), batch, TASKS["mlp"][3])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer)
    start = params(model)

    for mb in split_sizes(batch, UNEVEN_SIZES[4]):
        with acc.micro_batch():
            loss_sum, count = mlp_loss(model, mb)
            acc.backward(loss_sum, count)
        assert same(params(model), start), "a parameter moved before the window's end"
        assert all(p.grad is not None for p in model.parameters())
        assert acc.in_window
    result = acc.end_window()

    assert result.stepped and result.micro_batches == 4 and result.count == 13
    assert not acc.in_window
    assert not same(params(model), start)
    assert all(p.grad is None for p in model.parameters()), "gradients leaked past the window"
    assert max_rel_err(seen[0], expected) <= 1e-6  # the manual path is the same exact step


def test_scheduler_steps_once_per_optimizer_step_and_not_on_skips():
    model = make_model(MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    acc = ga.Accumulator(model, optimizer, scheduler=scheduler)

    def poisoned(model, mb):
        loss_sum, count = mlp_loss(model, mb)
        return loss_sum * float("nan"), count

    results = []
    for w in range(5):
        micro = ga.split(regression_batch(seed=w, n=12), 3)  # 4 micro-batches per window
        results.append(acc.step(micro, poisoned if w == 2 else mlp_loss))

    assert [r.stepped for r in results] == [True, True, False, True, True]
    assert len(steps) == 4 == acc.state.optimizer_steps
    assert scheduler.last_epoch == 4  # not 5 windows, not 20 micro-batches
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5**4)
    assert acc.state.windows == 5 and acc.state.micro_batches == 20 and acc.state.items == 60


@pytest.mark.parametrize("case", ["clipped", "below"])
def test_clipping_once_per_window_on_the_normalized_gradient(case):
    factory, make_batch, loss_fn, reference = TASKS["lm"]
    batch = make_batch(seed=7)
    full = reference_grads(make_model(factory), batch, reference)
    full_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in full.values()))
    # "below": under the normalized norm's clip level but far under the summed gradient's
    # norm (about count x larger), so clipping before normalization would wrongly clip.
    max_norm = full_norm / 2 if case == "clipped" else full_norm * 2
    model = make_model(factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer, max_grad_norm=max_norm)
    result = acc.step(split_sizes(batch, UNEVEN_SIZES[7]), loss_fn)

    assert result.grad_norm == pytest.approx(full_norm, rel=1e-5)  # reported before clipping
    scale = max_norm / (full_norm + 1e-6) if case == "clipped" else 1.0
    expected = {k: g * scale for k, g in full.items()}
    # Clipping per micro-batch would change the direction, not just the length; a match
    # with the clipped full-batch gradient shows it happened once, at the end.
    assert max_rel_err(seen[0], expected) <= 1e-6
    seen_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in seen[0].values()))
    assert seen_norm == pytest.approx(min(full_norm, max_norm), rel=1e-5)


def lm_setup(seed=0):
    model = make_model(TinyLM, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return (
        model,
        optimizer,
        ga.Accumulator(model, optimizer, scheduler=scheduler, max_grad_norm=1.0),
    )


def lm_window(seed):
    return ga.split(padded_lm_batch(seed=seed), 4)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_window_is_skipped_whole_and_training_goes_on(poison, caplog):
    _, _, lm_loss, _ = TASKS["lm"]

    def poisoned(model, mb):
        loss_sum, count = lm_loss(model, mb)
        if mb["input_ids"].shape[0] == 1:  # only the window's ragged last micro-batch
            loss_sum = loss_sum * poison
        return loss_sum, count

    # Reference: the same run without the bad window.
    ref_model, _, ref_acc = lm_setup()
    ref_acc.step(lm_window(1), lm_loss)
    ref_acc.step(lm_window(3), lm_loss)

    model, optimizer, acc = lm_setup()
    acc.step(lm_window(1), lm_loss)
    before_params, before_opt = params(model), optimizer_tensors(optimizer)
    lr_before = optimizer.param_groups[0]["lr"]

    result = acc.step(lm_window(2), poisoned)

    assert not result.stepped and result.skipped == "non-finite gradient"
    assert not math.isfinite(result.grad_norm)
    assert same(params(model), before_params)
    assert same(optimizer_tensors(optimizer), before_opt)
    assert optimizer.param_groups[0]["lr"] == lr_before
    assert all(p.grad is None for p in model.parameters())
    assert acc.state.skipped_windows == 1 and acc.state.optimizer_steps == 1
    assert "skipped (non-finite gradient" in caplog.text

    assert acc.step(lm_window(3), lm_loss).stepped
    assert same(params(model), params(ref_model)), "the bad window left a trace"


def test_zero_count_window_is_skipped_without_nan():
    _, _, lm_loss, _ = TASKS["lm"]
    model, optimizer, acc = lm_setup()
    acc.step(lm_window(1), lm_loss)
    before_params, before_opt = params(model), optimizer_tensors(optimizer)
    empty = padded_lm_batch(seed=2)
    empty["labels"][:] = -100  # every token ignored

    result = acc.step(ga.split(empty, 4), lm_loss)

    assert result.skipped == "zero count" and not result.stepped
    assert result.count == 0 and result.loss is None and result.grad_norm is None
    assert same(params(model), before_params)
    assert same(optimizer_tensors(optimizer), before_opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    nxt = acc.step(lm_window(3), lm_loss)
    assert nxt.stepped and math.isfinite(nxt.loss)


def test_a_micro_batch_with_no_item_contributes_nothing():
    """Count 0 inside an otherwise normal window is fine and changes nothing."""
    factory, make_batch, loss_fn, reference = TASKS["lm"]
    batch = make_batch(seed=8)
    expected = reference_grads(make_model(factory), batch, reference)
    extra = {k: v[:2].clone() for k, v in batch.items()}
    extra["labels"][:] = -100
    model = make_model(factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    ga.Accumulator(model, optimizer).step(ga.split(batch, 5) + [extra], loss_fn)
    assert max_rel_err(seen[0], expected) <= 1e-6


def test_gradients_already_present_are_refused_not_leaked():
    model = make_model(MLP)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_batch(seed=0)
    F.mse_loss(model(x), y).backward()  # a stray backward outside any window
    with pytest.raises(RuntimeError, match=r"net\.0\.weight already has a gradient"):
        acc.step(ga.split((x, y), 4), mlp_loss)


def test_an_exception_mid_window_leaves_parameters_and_no_gradient():
    model = make_model(MLP)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = params(model)
    calls = []

    def failing(model, mb):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("bad record")
        return mlp_loss(model, mb)

    with pytest.raises(KeyError):
        acc.step(ga.split(regression_batch(seed=0), 3), failing)
    assert same(params(model), start)
    assert all(p.grad is None for p in model.parameters()) and not acc.in_window
    assert acc.step(ga.split(regression_batch(seed=0), 3), mlp_loss).stepped


# -- one arithmetic on every path (regressions of a pre-division that only step() took) ------


def _bf16_or_fp32_loss(dtype):
    def loss_fn(model, mb):
        loss_sum, count = mlp_loss(model, mb)
        return loss_sum.to(dtype), count

    return loss_fn


def _fp64_reference(batch):
    model = make_model(MLP).double()
    x, y = batch
    return reference_grads(model, (x.double(), y.double()), TASKS["mlp"][3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_and_manual_mode_hand_the_optimizer_bitwise_the_same_gradient(dtype):
    """12 equal micro-batches: a loss_sum in bf16 once made step() pre-divide by bf16(1/12)
    (12 x that = 1.00195) and skip the final division, a 0.2% bias manual mode did not have."""
    batch = regression_batch(seed=7, n=48)
    micro = ga.split(batch, 4)
    loss_fn = _bf16_or_fp32_loss(dtype)
    grads = {}
    for path in ("step", "manual"):
        model = make_model(MLP)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = capture_step_grads(optimizer, model)
        acc = ga.Accumulator(model, optimizer)
        if path == "step":
            acc.step(micro, loss_fn)
        else:
            for i, mb in enumerate(micro):
                with acc.micro_batch(last=i == len(micro) - 1):
                    acc.backward(*loss_fn(model, mb))
            acc.end_window()
        grads[path] = seen[0]
    assert same(grads["step"], grads["manual"])
    expected = {n: g.float() for n, g in _fp64_reference(batch).items()}
    err = max_rel_err(grads["step"], expected)
    print(f"{dtype} loss_sum: step() against the fp64 full batch {err:.2e}")
    assert err <= 1e-5  # fp32 rounding; the bf16 factor's bias was 2e-3


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("path", ["step", "manual"])
def test_accumulated_gradient_is_the_raw_sum_on_every_path(path, precision):
    """After k micro-batches, the sum of their gradients: not divided by anything, on either
    path, with or without fp16 loss scaling (equal micro-batches once made step() return the
    sum already divided by first-count x N)."""
    batch = regression_batch(seed=3, n=24)
    micro = ga.split(batch, 6)
    expected = []  # the sum of the first k micro-batches' gradients, by torch alone
    for k in range(1, len(micro)):
        model = make_model(MLP)
        total = 0.0
        for mb in micro[:k]:  # one autocast region each, as the Accumulator runs them
            with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "fp16"):
                total = total + mlp_loss(model, mb)[0]
        total.backward()
        expected.append({n: p.grad for n, p in model.named_parameters()})

    model = make_model(MLP)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    seen = []

    def loss_fn(model, mb):  # before micro-batch k's forward: the sum of the first k
        so_far = acc.accumulated_gradient()
        if so_far:
            seen.append({n: g.clone() for n, g in so_far.items()})
        return mlp_loss(model, mb)

    if path == "step":
        acc.step(micro, loss_fn)
    else:
        for mb in micro:
            with acc.micro_batch():
                acc.backward(*loss_fn(model, mb))
        acc.end_window()
    errors = [max_rel_err(got, want) for got, want in zip(seen, expected, strict=True)]
    print(f"{path} {precision}: accumulated_gradient() against the summed gradients {errors}")
    assert max(errors) <= 1e-5


def test_load_state_dict_refuses_another_optimizer_layout_before_changing_anything():
    """It raised only after the model's weights were overwritten (issue 58), against its
    docstring's 'before changing anything'."""
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    two_groups = torch.optim.SGD(
        [{"params": source[0].parameters()}, {"params": source[1].parameters(), "lr": 0.1}],
        lr=0.01,
    )
    saved = ga.Accumulator(source, two_groups).state_dict()
    torch.manual_seed(1)
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    acc = ga.Accumulator(target, torch.optim.SGD(target.parameters(), lr=0.01))
    with pytest.raises(
        ValueError, match=r"parameter groups hold \[4\] parameters, the checkpoint's \[2, 2\]"
    ):
        acc.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    # a model of other shapes: named, nothing changed either
    saved["model"]["1.weight"] = torch.zeros(3, 4)
    saved["optimizer"] = acc.optimizer.state_dict()
    with pytest.raises(ValueError, match=r"1.weight is \(3, 4\), the model's \(2, 4\)"):
        acc.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def _stepped_state(model, optimizer):
    acc = ga.Accumulator(model, optimizer)
    acc.step([torch.randn(8, 16)], lambda m, b: (m(b).square().sum(), len(b)))
    return acc.state_dict()


@pytest.mark.parametrize("case", ["parameters in another order", "another optimizer"])
def test_load_state_dict_refuses_another_optimizer_state_before_changing_anything(case):
    """The same group sizes, another order of parameters (by layer in the checkpoint, by
    weight and bias here): it loaded each moment onto another parameter's shape and failed
    at the next step; SGD's state into AdamW raised KeyError after the weights changed
    (issue 58). Both are refused before anything changes; a state that fits still loads."""
    torch.manual_seed(0)

    def net():
        return torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.Linear(4, 16))

    source = net()
    if case == "another optimizer":
        saved = _stepped_state(source, torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9))
        target = net()
        optimizer = torch.optim.AdamW(target.parameters())
        reason = r"KeyError: 'step'"
    else:
        by_layer = [{"params": source[0].parameters()}, {"params": source[1].parameters()}]
        saved = _stepped_state(source, torch.optim.AdamW(by_layer))
        target = net()
        optimizer = torch.optim.AdamW(
            [{"params": [target[0].weight, target[1].bias]},
             {"params": [target[0].bias, target[1].weight]}]
        )  # fmt: skip
        reason = r"RuntimeError: .*broadcast"
    before = {k: v.clone() for k, v in target.state_dict().items()}
    acc = ga.Accumulator(target, optimizer)
    with pytest.raises(ValueError, match=f"optimizer state does not load into or step.*{reason}"):
        acc.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert not optimizer.state  # nothing loaded into it either
    # the checkpoint's own setup loads it, with a scheduler wrapping its optimizer's step
    again = net()
    if case == "another optimizer":
        fits = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    else:
        fits = torch.optim.AdamW([{"params": again[0].parameters()},
                                  {"params": again[1].parameters()}])  # fmt: skip
    torch.optim.lr_scheduler.StepLR(fits, 1)
    ga.Accumulator(again, fits).load_state_dict(saved)
    assert torch.equal(again[0].weight, source[0].weight) and fits.state
