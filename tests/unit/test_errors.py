"""Bad input gets an error that names the value and what was expected."""

import pytest
import torch
import torch.nn.functional as F
from helpers import MLP, make_model, mlp_loss, params, regression_batch

import gradaccum as ga


@pytest.fixture
def setup():
    model = make_model(MLP)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model, acc, ga.split(regression_batch(seed=0), 4)


def returning(loss=None, count=None):
    def loss_fn(model, mb):
        loss_sum, n = mlp_loss(model, mb)
        return (loss_sum if loss is None else loss(model, mb)), (n if count is None else count)

    return loss_fn


def per_sample(model, mb):
    x, y = mb
    return F.mse_loss(model(x), y, reduction="none").mean(1)


@pytest.mark.parametrize(
    "loss_fn, error, pattern",
    [
        (
            returning(loss=per_sample),
            ValueError,
            r"0-dim tensor .* got shape \(4,\) from micro-batch 0",
        ),
        (returning(count=-3), ValueError, r"non-negative integer, got -3 from micro-batch 0"),
        (returning(count=2.5), ValueError, r"non-negative integer, got 2\.5 from micro-batch 0"),
        (returning(count=True), ValueError, r"non-negative integer, got True"),
        (returning(count="4"), ValueError, r"non-negative integer, got '4'"),
        (returning(count=torch.tensor(-3)), ValueError, r"got -3 from micro-batch 0"),
        (returning(count=torch.tensor(2.5)), ValueError, r"got 2\.5 from micro-batch 0"),
        (returning(count=torch.ones(2)), ValueError, r"0-dim tensor, got a tensor of shape \(2,\)"),
        (
            returning(count=torch.tensor(True)),
            ValueError,
            r"real number of items, got dtype torch.bool",
        ),
        (returning(count=torch.tensor(4 + 0j)), ValueError, r"got dtype torch.complex64"),
        (returning(loss=lambda m, mb: torch.tensor(1.0)), ValueError, r"does not require grad"),
        (
            returning(loss=lambda m, mb: 1.0),
            TypeError,
            r"loss_sum must be a 0-dim tensor, got float",
        ),
        (
            lambda m, mb: mlp_loss(m, mb)[0],
            TypeError,
            r"must return \(loss_sum, count\), got a Tensor",
        ),
        (
            lambda m, mb: (*mlp_loss(m, mb), 0),
            TypeError,
            r"got a tuple of length 3 from micro-batch 0",
        ),
    ],
    ids=[
        "non-scalar-loss",
        "negative-count",
        "fractional-count",
        "bool-count",
        "str-count",
        "negative-tensor-count",
        "fractional-tensor-count",
        "vector-count",
        "bool-tensor-count",
        "complex-tensor-count",
        "loss-without-grad",
        "float-loss",
        "bare-loss",
        "three-values",
    ],
)
def test_bad_loss_fn_results(setup, loss_fn, error, pattern):
    model, acc, micro = setup
    start = params(model)
    with pytest.raises(error, match=pattern):
        acc.step(micro, loss_fn)
    # nothing is lost: parameters untouched, no gradient left, the next window works
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters()) and not acc.in_window
    assert acc.step(micro, mlp_loss).stepped


def test_tensor_count_error_names_the_micro_batch(setup):
    _, acc, micro = setup
    calls = []

    def loss_fn(model, mb):
        calls.append(1)
        loss_sum, n = mlp_loss(model, mb)
        return loss_sum, torch.tensor(-1 if len(calls) == 3 else n)

    with pytest.raises(ValueError, match=r"got -1 from micro-batch 2"):
        acc.step(micro, loss_fn)


def test_empty_window(setup):
    _, acc, _ = setup
    with pytest.raises(ValueError, match="empty window"):
        acc.step([], mlp_loss)
    with pytest.raises(ValueError, match="empty window"):
        acc.end_window()


@pytest.mark.parametrize("size", [0, -2, 1.5, True, "4"])
def test_micro_size_below_one_or_not_an_integer(size):
    with pytest.raises(ValueError, match=rf"micro_size must be an integer >= 1, got {size!r}"):
        ga.split(torch.zeros(8, 2), size)


def test_windows_size_must_be_positive():
    with pytest.raises(
        ValueError, match="n .micro-batches per window. must be an integer >= 1, got 0"
    ):
        list(ga.windows([1, 2], 0))


def test_model_with_no_trainable_parameters():
    model = make_model(MLP)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters \(4 parameters, none with"):
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_constructor_arguments_are_checked():
    model = make_model(MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        ga.Accumulator([model], opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        ga.Accumulator(model, {})
    for bad in (0, -1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="max_grad_norm must be a positive finite number"):
            ga.Accumulator(model, opt, max_grad_norm=bad)
    # every bad value in one message, as docs/api.md promises
    with pytest.raises(ValueError) as err:
        ga.Accumulator(model, opt, max_grad_norm=-1, precision="fp8", sync="bogus")
    assert str(err.value) == (
        "max_grad_norm must be a positive finite number or None, got -1; precision must be "
        "one of 'fp32', 'bf16', 'fp16', got 'fp8'; sync must be one of 'window', 'micro', "
        "got 'bogus'"
    )


def test_a_batch_passed_where_micro_batches_belong(setup):
    _, acc, _ = setup
    with pytest.raises(TypeError, match=r"got a Tensor; split a batch first with ga.split"):
        acc.step(torch.zeros(8, 6), mlp_loss)


def test_manual_mode_misuse(setup):
    model, acc, micro = setup
    with pytest.raises(RuntimeError, match="inside `with acc.micro_batch"):
        acc.backward(*mlp_loss(model, micro[0]))
    with pytest.raises(RuntimeError, match="backward\\(\\) called twice in micro-batch 0"):
        with acc.micro_batch():
            acc.backward(*mlp_loss(model, micro[0]))
            acc.backward(*mlp_loss(model, micro[1]))
    assert not acc.in_window  # the error dropped the window
    with pytest.raises(RuntimeError, match="micro-batch 0 ended without acc.backward"):
        with acc.micro_batch():
            pass
    with acc.micro_batch():
        with pytest.raises(RuntimeError, match="micro_batch\\(\\) contexts do not nest"):
            with acc.micro_batch():
                pass
        acc.backward(*mlp_loss(model, micro[0]))  # the outer context is still usable
    with pytest.raises(RuntimeError, match="manual window is open with 1 micro-batches"):
        acc.step(micro, mlp_loss)
    with pytest.raises(RuntimeError, match="checkpoint between windows"):
        acc.state_dict()
    assert acc.end_window().stepped


def test_counts_on_an_accelerator_are_checked_at_the_window_end():
    """Counts on a GPU are summed and checked once per window (one host sync). No GPU here, so
    the check itself is called on a window holding such counts, as end_window would."""
    from gradaccum.loss import tensor_count_total

    counts = [(0, torch.tensor(5)), (1, torch.tensor(7))]
    assert tensor_count_total(counts) == 12
    counts.append((2, torch.tensor(-2.0)))
    with pytest.raises(ValueError, match=r"got -2 from micro-batch 2"):
        tensor_count_total(counts)


def test_numpy_counts_are_numbers_and_a_batch_is_not_a_window():
    """np.int64(8) was refused while 8.0 was accepted; a (x, y) batch handed to step() ended
    in torch's error from inside the loss."""
    np = pytest.importorskip("numpy")
    batch = regression_batch(seed=2, n=8)

    def numpy_count(model, mb):
        loss_sum, count = mlp_loss(model, mb)
        return loss_sum, np.int64(count)

    results = []
    for loss_fn in (mlp_loss, numpy_count):
        model = make_model(MLP)
        acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        results.append(acc.step(ga.split(batch, 4), loss_fn))
    assert results[0].count == results[1].count == 8
    assert results[0].grad_norm == results[1].grad_norm
    model = make_model(MLP)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"got a tuple of 2 tensors: a batch such as \(inputs"):
        acc.step(batch, mlp_loss)
