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
from gradaccum.integrations.lightning import (  # noqa: E402
    ExactAccumulation,
    OOMReplayStrategy,
    exact_output,
)


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


def run_with_fault(fault=None, oom=None):
    """Three windows of 16 padded sequences (4 micro-batches of 4) at SGD 0.1, with the
    callback: each step's gradient, the final weights and the trainer's last logged values.
    ``fault(model)`` makes the device run out of memory partway through."""
    model = tiny_gpt2()
    if fault is not None:
        fault(model)
    module = LM(model, exact=True, lr=0.1)
    # a callback's hooks cannot carry a fit past an error: the replay is the strategy's
    strategy = {} if oom is None else {"strategy": OOMReplayStrategy()}
    trainer = fit(module, padded_sequences(48), [ExactAccumulation(oom=oom)], **strategy)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return module.optimizer.seen, weights, trainer.callback_metrics


@pytest.mark.parametrize(("phase", "calls"), [("forward", 6), ("backward", 6), ("forward", 4)])
def test_out_of_memory_mid_window_replays_it_to_the_same_step(phase, calls, caplog):
    """The device holds 2 sequences after ``calls`` micro-batches (6: from the second window's
    third; 4: from its first, where Lightning zeroes the gradient between the training step
    and its backward): the forward (or backward) runs out of memory; the callback replays the
    window at 2 from its first micro-batch, the rest of the run at 2. Every step as without
    the fault."""
    from support.faults import oom_after

    import gradaccum as ga

    clean, clean_weights, _ = run_with_fault()
    faults = []

    def fault(model):
        faults.append(oom_after(model.transformer.h[0], calls, 2, phase=phase))

    with caplog.at_level("WARNING", logger="gradaccum"):
        seen, weights, logged = run_with_fault(fault, ga.OOMReplay())
    assert faults[0].faults == 1
    assert len(seen) == len(clean) == 3
    errors = [rel_err(a, b) for a, b in zip(seen, clean, strict=True)]
    drift = rel_err(weights, clean_weights)
    print(
        f"Lightning, out of memory in the {phase} mid-window: steps {errors}, weights {drift:.1e}"
    )
    assert max(errors) <= 1e-6 and drift <= 1e-6
    assert "out of memory at micro-batch size 4; replaying the window at 2" in caplog.text
    assert float(logged["oom_replays"]) == 1.0


def test_replay_without_its_strategy_is_refused_in_one_line_with_the_reason():
    import gradaccum as ga

    with pytest.raises(ValueError) as error:
        fit(
            LM(tiny_gpt2(), exact=True),
            padded_sequences(16),
            [ExactAccumulation(oom=ga.OOMReplay())],
        )
    message = str(error.value)
    assert (
        "\n" not in message and "oom= needs Trainer(strategy=OOMReplayStrategy(device))" in message
    )
    assert "never around them" in message


def test_the_callback_leaves_lightnings_strategy_as_it_was():
    """No method of Lightning's objects is replaced: the strategy's training_step and
    backward are its class's, before the fit and after it, with and without replay."""
    import gradaccum as ga

    for oom, strategy in ((None, "auto"), (ga.OOMReplay(), OOMReplayStrategy())):
        trainer = fit(
            LM(tiny_gpt2(), exact=True), padded_sequences(16), [ExactAccumulation(oom=oom)],
            strategy=strategy,
        )  # fmt: skip
        for name in ("training_step", "backward"):
            assert name not in vars(trainer.strategy)


def test_out_of_memory_without_replay_ends_training():
    from support.faults import oom_after

    with pytest.raises(torch.OutOfMemoryError):
        run_with_fault(lambda m: oom_after(m.transformer.h[0], 6, 2))


def test_a_batch_schedule_runs_the_ramps_windows_each_exact():
    """A linear ramp from 8 to 32 sequences over the first 64, micro-batches of 4, on 96
    padded sequences: Lightning steps after each of the ramp's windows (8, 12, 16, 20, 28,
    then the 12 left: worked out in the Trainer's test, independently of gradaccum), each
    step's gradient its window's full-batch mean."""
    from test_transformers_trainer import ramp

    import gradaccum as ga

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(96)
    module = LM(model, exact=True)
    schedule = ga.BatchSchedule("linear:64=32", start=8, unit=4)
    callback = ExactAccumulation(schedule=schedule)
    fit(module, items, [callback])
    want = ramp(8, 32, 64, 4, 96)
    assert len(module.optimizer.seen) == len(want) and schedule.samples == 96
    edges = [sum(want[:i]) for i in range(len(want) + 1)]
    errors = []
    for grads, a, b in zip(module.optimizer.seen, edges[:-1], edges[1:], strict=True):
        full = full_batch_grads(reference, items[a:b])
        errors.append(rel_err(grads, full))
    print(f"Lightning, the ramp's windows {want}: errors {max(errors):.1e} at most")
    assert max(errors) <= 1e-6
    assert callback.state_dict()["schedule"]["step"] == len(want)  # for Lightning's checkpoints


class RegressionModule(lightning.LightningModule):
    def __init__(self, problem) -> None:
        super().__init__()
        self.problem, self.model = problem, problem.model()
        self.optimizer = None

    def training_step(self, batch, batch_idx):
        return exact_output(self, *self.problem.loss(self.model, *batch))

    def configure_optimizers(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.optimizer = RecordingSGD(self.model.parameters(), names, lr=0.0)
        return self.optimizer


@pytest.mark.slow  # 4,096 samples in windows of 8 to 20
def test_the_auto_schedule_raises_the_batch_as_gradaccums_own_loop_does():
    """The regression problem with a known B_simple, auto from 8 samples (2 micro-batches of
    4), at most 64, over 4,096 samples: Lightning's windows are the ones gradaccum's own loop
    takes on the same samples, the batch rises above 8, every window exact."""
    from test_transformers_trainer import accumulator_auto_windows

    import gradaccum as ga

    problem = Regression(windows=32)
    module = RegressionModule(problem)
    data = list(zip(problem.x, problem.y, strict=True))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    schedule = ga.BatchSchedule("auto", start=8, unit=4, maximum=64)
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[ExactAccumulation(noise=problem.noise(), schedule=schedule)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    sizes = accumulator_auto_windows(problem, 4096, 4)
    assert max(sizes) > 8 and schedule.step == len(sizes)
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    reference = problem.model()
    errors = []
    for grads, a, b in zip(module.optimizer.seen, edges[:-1], edges[1:], strict=True):
        reference.zero_grad()
        (0.5 * (reference(problem.x[a:b]).squeeze(1) - problem.y[a:b]) ** 2).mean().backward()
        errors.append(rel_err(grads, {"weight": reference.weight.grad}))
    print(
        f"Lightning, auto: {len(sizes)} windows of {sorted(set(sizes))}, errors {max(errors):.1e}"
    )
    assert max(errors) <= 1e-6


def test_a_schedule_beside_lightnings_own_accumulation_scheduler_is_refused():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    import gradaccum as ga

    callbacks = [
        ExactAccumulation(schedule=ga.BatchSchedule("constant", start=8, unit=4)),
        GradientAccumulationScheduler({0: 2}),
    ]
    with pytest.raises(ValueError, match="GradientAccumulationScheduler sets accumulate_grad"):
        fit(LM(tiny_gpt2(), exact=True), padded_sequences(16), callbacks, accumulate=1)
