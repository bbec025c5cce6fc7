"""Accumulated windows equal the full batch, checked against a plain full-batch loop."""

import pytest
import torch
from helpers import (
    TASKS,
    UNEVEN_SIZES,
    capture_step_grads,
    lm_reference,
    make_model,
    max_rel_err,
    padded_lm_batch,
    params,
    reference_grads,
    split_sizes,
    trim,
)

import gradaccum as ga

GRAD_TOL = 1e-6
PARAM_TOL = 1e-5
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
}


@pytest.mark.parametrize("n", sorted(UNEVEN_SIZES))
@pytest.mark.parametrize("task", sorted(TASKS))
def test_window_gradient_equals_full_batch(task, n):
    """In float64: what is compared is the window's arithmetic (its normalization), not
    float32's summation order, which a single-threaded conv's backward changes by 1e-6 (the
    CNN failed at 1.1e-6 under OMP_NUM_THREADS=1, passed with 2)."""
    factory, make_batch, loss_fn, reference = TASKS[task]
    batch = ga.batching.map_tensors(
        make_batch(seed=1), lambda t: t.double() if t.is_floating_point() else t
    )
    expected = reference_grads(make_model(factory).double(), batch, reference)

    model = make_model(factory).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    result = ga.Accumulator(model, optimizer).step(split_sizes(batch, UNEVEN_SIZES[n]), loss_fn)

    assert result.stepped and result.micro_batches == n
    assert len(seen) == 1
    err = max_rel_err(seen[0], expected)
    assert err <= GRAD_TOL, f"{task} N={n}: gradient relative error {err:.2e}"
    # The reported loss is the full batch's mean loss.
    with torch.no_grad():
        full_loss = reference(make_model(factory).double(), batch).item()
    assert result.loss == pytest.approx(full_loss, rel=1e-6)


def plain_loop(factory, make_optimizer, batches, reference):
    """The textbook loop: mean loss over the full batch, backward, step."""
    model = make_model(factory)
    optimizer = make_optimizer(model.parameters())
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        reference(model, batch).backward()
        optimizer.step()
    return params(model)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", sorted(UNEVEN_SIZES))
@pytest.mark.parametrize("task", sorted(TASKS))
def test_three_steps_match_full_batch_training(task, n, opt):
    factory, make_batch, loss_fn, reference = TASKS[task]
    batches = [make_batch(seed=s) for s in (11, 12, 13)]
    expected = plain_loop(factory, OPTIMIZERS[opt], batches, reference)

    model = make_model(factory)
    acc = ga.Accumulator(model, OPTIMIZERS[opt](model.parameters()))
    for batch in batches:
        assert acc.step(split_sizes(batch, UNEVEN_SIZES[n]), loss_fn).stepped
    got = params(model)

    err = max_rel_err(got, expected)
    assert err <= PARAM_TOL, f"{task} N={n} {opt}: parameter relative error {err:.2e}"
    # and training moved them: the comparison is not between two untouched models
    start = params(make_model(factory))
    assert max_rel_err(got, start) > 1e-3


def test_split_and_windows_feed_the_same_gradient():
    """The library's own splitting, with a ragged last micro-batch, is exact too."""
    factory, make_batch, loss_fn, reference = TASKS["lm"]
    batch = make_batch(seed=3)
    expected = reference_grads(make_model(factory), batch, reference)
    model = make_model(factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    micro = ga.split(batch, 4)  # 13 = 4 + 4 + 4 + 1
    assert [m["input_ids"].shape[0] for m in micro] == [4, 4, 4, 1]
    (window,) = list(ga.windows(micro, 4))
    ga.Accumulator(model, optimizer).step(window, loss_fn)
    assert max_rel_err(seen[0], expected) <= GRAD_TOL


def test_ragged_last_window_is_its_own_mean():
    """7 micro-batches in windows of 3: the last window of 1 is normalized by its own count."""
    factory, _, loss_fn, reference = TASKS["lm"]
    batch = padded_lm_batch(seed=4, n=14)
    micro = ga.split(batch, 2)
    wins = list(ga.windows(micro, 3))
    assert [len(w) for w in wins] == [3, 3, 1]

    model = make_model(factory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer)
    for window in wins:
        acc.step(window, loss_fn)
    last = {k: torch.cat([m[k] for m in wins[-1]]) for k in batch}
    expected = reference_grads(make_model(factory), last, reference)
    assert max_rel_err(seen[-1], expected) <= GRAD_TOL


def naive_grads(model, micro_batches):
    """What many loops do: mean loss per micro-batch, divided by the number of micro-batches."""
    model.zero_grad(set_to_none=True)
    for mb in micro_batches:
        (lm_reference(model, trim(mb)) / len(micro_batches)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_naive_per_micro_batch_mean_is_wrong_on_padded_lm():
    """Guards the difference: if the suite's LM case stopped being sensitive to
    normalization, the equivalence tests above would prove nothing."""
    batch = padded_lm_batch(seed=1)
    micro = split_sizes(batch, UNEVEN_SIZES[4])
    expected = reference_grads(make_model(TASKS["lm"][0]), batch, lm_reference)
    naive = naive_grads(make_model(TASKS["lm"][0]), micro)
    err = max_rel_err(naive, expected)
    print(f"naive mean/N gradient error on the padded LM: {err:.1%}")
    assert err > 0.10


@pytest.mark.parametrize("task", ["mlp", "cnn"])
def test_equal_micro_batches_arrive_normalized_and_stay_exact(task):
    """Equal counts: step() pre-divides each loss by the first count times N, which is the
    total, so the window's sum arrives normalized and no division pass runs. The full-batch
    loop is the judge, for the gradient and for three AdamW steps with clipping that bites."""
    factory, make_batch, loss_fn, reference = TASKS[task]
    batches = [make_batch(seed=s, n=16) for s in (21, 22, 23)]
    expected = reference_grads(make_model(factory), batches[0], reference)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected.values()]))

    model = make_model(factory)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    seen = capture_step_grads(optimizer, model)
    acc = ga.Accumulator(model, optimizer, max_grad_norm=float(norm) / 2)
    results = [acc.step(ga.split(batch, 4), loss_fn) for batch in batches]
    assert all(r.micro_batches == 4 and r.count == 16 for r in results)
    clipped = {k: v * (float(norm) / 2) / (float(norm) + 1e-6) for k, v in expected.items()}
    err = max_rel_err(seen[0], clipped)
    assert err <= GRAD_TOL, f"{task}: gradient relative error {err:.2e}"
    assert results[0].grad_norm == pytest.approx(float(norm), rel=1e-5)

    model_ref = make_model(factory)
    optimizer_ref = OPTIMIZERS["adamw"](model_ref.parameters())
    for batch in batches:
        optimizer_ref.zero_grad(set_to_none=True)
        reference(model_ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(model_ref.parameters(), float(norm) / 2)
        optimizer_ref.step()
    err = max_rel_err(params(model), params(model_ref))
    assert err <= PARAM_TOL, f"{task}: parameter relative error {err:.2e}"
