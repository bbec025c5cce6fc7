"""gradaccum.integrations.lightning.ExactAccumulation inside a real Lightning Trainer with
accumulate_grad_batches=4: the gradient each optimizer step applies (recorded by the
optimizer itself, clipping off) against one full-batch backward. Lightning's plain recipe
(a mean loss per micro-batch) is printed beside it."""

from __future__ import annotations

import copy

import pytest
import torch
from frameworks import (
    RecordingSGD,
    Regression,
    full_batch_grads,
    padded_sequences,
    rel_err,
    stack,
    tiny_gpt2,
    token_sum_loss,
)

lightning = pytest.importorskip("lightning")
from gradaccum.integrations.lightning import ExactAccumulation, exact_output  # noqa: E402


class LM(lightning.LightningModule):
    """The tiny GPT-2; ``exact`` returns the summed loss through exact_output, otherwise the
    per-micro-batch token mean (the recipe Lightning's docs show)."""

    def __init__(self, model, exact: bool, lr: float = 0.0) -> None:
        super().__init__()
        self.model, self.exact, self.lr = model, exact, lr
        self.optimizer = None

    def training_step(self, batch, batch_idx):
        loss_sum, count = token_sum_loss(self.model, batch)
        if self.exact:
            return exact_output(self, loss_sum, count)
        return loss_sum / count

    def configure_optimizers(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.optimizer = RecordingSGD(self.model.parameters(), names, lr=self.lr)
        return self.optimizer


def fit(module, items, callbacks=(), batch_size=4, accumulate=4, **trainer_kwargs):
    loader = torch.utils.data.DataLoader(items, batch_size=batch_size, collate_fn=stack)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return trainer


def window_errors(n_items: int, exact: bool) -> list[float]:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(n_items)
    module = LM(model, exact)
    fit(module, items, [ExactAccumulation()] if exact else [])
    seen = [{f"model.{k}": v for k, v in grads.items()} for grads in module.optimizer.seen]
    assert len(seen) == -(-n_items // 16)
    errors = []
    for w, grads in enumerate(seen):
        want = full_batch_grads(reference, items[16 * w : 16 * w + 16])
        errors.append(rel_err(grads, {f"model.{k}": v for k, v in want.items()}))
    return errors


def test_a_full_window_gives_the_full_batch_gradient():
    plain, ours = window_errors(16, exact=False), window_errors(16, exact=True)
    print(f"full window: plain Lightning {plain[0]:.2f}, ExactAccumulation {ours[0]:.1e}")
    assert ours[0] <= 1e-6


def test_the_ragged_last_window_gives_its_full_batch_gradient():
    """28 sequences in windows of 4 micro-batches of 4: the last window holds 3."""
    plain, ours = window_errors(28, exact=False), window_errors(28, exact=True)
    print(f"ragged: plain Lightning {plain}, ExactAccumulation {ours}")
    assert max(ours) <= 1e-6


@pytest.mark.slow
def test_b_simple_is_logged_and_matches_the_accumulator():
    """The linear-regression problem of tests/unit/test_noise.py, closed form
    B_simple = d + 1 + d s^2 / |delta|^2, inside the reported interval and within 15%; the
    Accumulator on the same micro-batches gives the same number."""
    problem = Regression()

    class Linear(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = problem.model()

        def training_step(self, batch, batch_idx):
            return exact_output(self, *problem.loss(self.linear, *batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    callback = ExactAccumulation(noise=problem.noise())
    module = Linear()
    items = list(zip(problem.x, problem.y, strict=True))
    loader = torch.utils.data.DataLoader(items, batch_size=16)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=8,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    logged = float(trainer.callback_metrics["b_simple"])
    print(f"B_simple logged {logged:.1f}, analytic {problem.analytic:.1f}")
    assert logged == pytest.approx(problem.analytic, rel=0.15)
    low, high = callback.window.noise.reading().interval
    assert low < problem.analytic < high
    want = problem.accumulator_b_simple()
    assert callback.last.b_simple == pytest.approx(want, rel=1e-9)
    assert logged == pytest.approx(want, rel=1e-6)  # logged as float32


def test_a_training_step_without_exact_output_is_refused():
    module = LM(tiny_gpt2(), exact=False)
    with pytest.raises(RuntimeError, match="must return exact_output"):
        fit(module, padded_sequences(8), [ExactAccumulation()])


def test_manual_optimization_is_refused():
    class Manual(LM):
        def __init__(self, model):
            super().__init__(model, exact=True)
            self.automatic_optimization = False

    # (Lightning itself refuses accumulate_grad_batches > 1 with manual optimization)
    with pytest.raises(ValueError, match="manual optimization"):
        fit(Manual(tiny_gpt2()), padded_sequences(8), [ExactAccumulation()], accumulate=1)


def test_named_terms_are_refused_in_one_line_with_where_they_work():
    loss = torch.zeros((), requires_grad=True)
    with pytest.raises(TypeError, match=r"named terms .*Accumulator \(step\(\.\.\., counts=fn\)\)"):
        exact_output(None, {"ce": (loss, 1), "aux": (loss, 1, 0.1)}, None)
