"""gradaccum.integrations.transformers.Trainer inside a real transformers.Trainer run: the
gradient handed to the optimizer (captured by an optimizer pre-hook, clipping off) against
one full-batch backward. The plain Trainer's error on the same run is printed beside it."""

from __future__ import annotations

import copy

import pytest
import torch
from frameworks import (
    Regression,
    full_batch_grads,
    padded_sequences,
    rel_err,
    stack,
    tiny_gpt2,
    token_sum_loss,
)
from frameworks import (
    trainer_arguments as arguments,
)
from helpers import capture_step_grads

transformers = pytest.importorskip("transformers")
from gradaccum.integrations.transformers import Trainer  # noqa: E402
from gradaccum.noise import NoiseScale  # noqa: E402


def train_at_lr0(tmp_path, n_items, trainer_class=None, **kwargs):
    """One epoch of ``n_items`` padded sequences at learning rate 0 (every window sees the
    same weights): the untrained copy for references, the items, each step's gradient and
    the trainer."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(n_items)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = (trainer_class or Trainer)(
        model=model,
        args=arguments(tmp_path),
        train_dataset=items,
        optimizers=(optimizer, None),
        **kwargs,
    )
    trainer.train()
    return reference, items, seen, trainer


def window_errors(tmp_path, trainer_class, n_items, **kwargs) -> list[float]:
    """Train one epoch at learning rate 0 (every window sees the same weights) and return
    each window's relative gradient error against the full batch of its 16 items."""
    reference, items, seen, _ = train_at_lr0(tmp_path, n_items, trainer_class, **kwargs)
    assert len(seen) == -(-n_items // 16)
    return [
        rel_err(grads, full_batch_grads(reference, items[16 * w : 16 * w + 16]))
        for w, grads in enumerate(seen)
    ]


def test_the_models_own_loss_gives_the_full_batch_gradient(tmp_path):
    plain = window_errors(tmp_path / "plain", transformers.Trainer, 16)
    ours = window_errors(tmp_path / "ours", Trainer, 16)
    print(f"GPT2LMHeadModel's own loss: plain Trainer {plain[0]:.1e}, gradaccum {ours[0]:.1e}")
    assert ours[0] <= 1e-6


def test_a_custom_sum_and_count_loss_gives_the_full_batch_gradient(tmp_path):
    ours = window_errors(tmp_path, Trainer, 16, loss_fn=token_sum_loss)
    print(f"custom (loss_sum, count): gradaccum {ours[0]:.1e}")
    assert ours[0] <= 1e-6


def test_the_ragged_last_window_gives_its_full_batch_gradient(tmp_path):
    """28 sequences in windows of 4 micro-batches of 4: the last window holds 3."""
    plain = window_errors(tmp_path / "plain", transformers.Trainer, 28)
    ours = window_errors(tmp_path / "ours", Trainer, 28)
    print(f"ragged last window: plain Trainer {plain}, gradaccum {ours}")
    assert max(ours) <= 1e-6


def test_evaluation_keeps_the_trainers_mean_loss(tmp_path):
    model = tiny_gpt2()
    items = padded_sequences(8)
    trainer = Trainer(model=model, args=arguments(tmp_path), eval_dataset=items)
    got = trainer.evaluate()["eval_loss"]
    plain = transformers.Trainer(model=model, args=arguments(tmp_path), eval_dataset=items)
    assert got == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)


def test_b_simple_is_logged_and_matches_the_closed_form(tmp_path):
    """The linear-regression problem of tests/unit/test_noise.py (its closed form,
    B_simple = d + 1 + d s^2 / |delta|^2), trained through the Trainer at learning rate 0,
    400 windows, all averaged (a stationary problem: horizon 1). The Accumulator on the same
    micro-batches must give the same number: one arithmetic on both paths."""
    problem = Regression()
    items = [{"x": xi, "y": yi} for xi, yi in zip(problem.x, problem.y, strict=True)]

    def loss_fn(model, inputs):
        return problem.loss(model, inputs["x"], inputs["y"])

    args = arguments(
        tmp_path,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=8,
        logging_steps=400,
        remove_unused_columns=False,
    )
    model = problem.model()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=items,
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None),
        loss_fn=loss_fn,
        noise=problem.noise(),
    )
    trainer.train()
    logged = [entry["b_simple"] for entry in trainer.state.log_history if "b_simple" in entry]
    print(f"B_simple logged {logged[-1]:.1f}, analytic {problem.analytic:.1f}")
    assert logged[-1] == pytest.approx(problem.analytic, rel=0.15)
    assert logged[-1] == pytest.approx(problem.accumulator_b_simple(), rel=1e-9)


def test_what_it_cannot_do_exactly_is_refused(tmp_path):
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        Trainer(model=tiny_gpt2(), args=arguments(tmp_path), loss_fn=3)
    items = [{"input_ids": item["input_ids"]} for item in padded_sequences(4)]
    trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=items)
    with pytest.raises(ValueError, match="needs `labels` in every training batch"):
        trainer.train()
    args = arguments(tmp_path, auto_find_batch_size=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_sequences(16))
    with pytest.raises(ValueError, match="auto_find_batch_size halves the micro-batch"):
        trainer.train()
    args = arguments(tmp_path, label_smoothing_factor=0.1)
    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=padded_sequences(16), loss_fn=token_sum_loss
    )
    with pytest.raises(ValueError, match="with loss_fn= given, smooth inside it"):
        trainer.train()


def _token_losses(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).clamp(min=0),
        reduction="none",
    ).reshape(labels.shape)
    return losses, labels != -100


def test_named_terms_with_counts_give_the_full_batch_gradient(tmp_path):
    """Two terms, per token and per sequence (weight 0.5), over windows of 4 micro-batches
    whose token counts differ: against one backward of the whole window's loss (torch)."""
    from frameworks import stack

    import gradaccum as ga

    def loss_fn(model, batch):
        losses, mask = _token_losses(model, batch)
        return {"ce": ga.per_token(losses, mask), "seq": (*ga.per_sequence(losses, mask), 0.5)}

    def counts(batch):
        mask = batch["labels"][:, 1:] != -100
        return {"ce": ga.token_count(mask), "seq": ga.sequence_count(mask)}

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=items,
        optimizers=(optimizer, None),
        loss_fn=loss_fn,
        counts=counts,
    )
    trainer.train()
    losses, mask = _token_losses(reference, stack(items))
    per_sequence = (losses * mask).sum(1) / mask.sum(1)
    reference.zero_grad(set_to_none=True)
    (losses[mask].mean() + 0.5 * per_sequence.mean()).backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    err = rel_err(seen[0], want)
    print(f"two named terms in the Trainer: gradaccum {err:.1e}")
    assert len(seen) == 1 and err <= 1e-6
    logged = [x for x in trainer.state.log_history if "loss_ce" in x]
    assert logged and logged[0]["loss_seq"] == pytest.approx(per_sequence.mean().item(), rel=1e-5)


def test_compute_loss_func_is_refused_in_one_line(tmp_path):
    """transformers calls compute_loss_func with its own count and takes the result as
    already divided by it; gradaccum cannot read that back as a sum, so it refuses (it was
    silently never called: the run trained on the model's own loss)."""
    calls = []

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        calls.append(num_items_in_batch)
        return outputs.logits.sum() * 0.0

    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp_path),
        train_dataset=padded_sequences(16),
        compute_loss_func=compute_loss_func,
    )
    with pytest.raises(ValueError, match="compute_loss_func returns a loss already divided"):
        trainer.train()
    assert calls == []


def test_label_smoothing_is_the_full_batchs_smoothed_loss(tmp_path):
    """label_smoothing_factor 0.1 on the model's own (causal) loss: the window's gradient is
    the smoothed cross-entropy's over the whole batch (torch alone); it used to be the
    unsmoothed one's, which is measurably different."""
    from frameworks import stack

    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    items = padded_sequences(16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    Trainer(
        model=model,
        args=arguments(tmp_path, label_smoothing_factor=0.1),
        train_dataset=items,
        optimizers=(optimizer, None),
    ).train()
    batch = stack(items)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:].reshape(-1)
    smoothed = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels, label_smoothing=0.1
    )
    smoothed.backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    unsmoothed = full_batch_grads(copy.deepcopy(model), items)
    err = rel_err(seen[0], want)
    print(f"label smoothing 0.1: gradaccum {err:.1e}; unsmoothed {rel_err(unsmoothed, want):.2e}")
    assert err <= 1e-6 and rel_err(unsmoothed, want) > 1e-3


def test_a_resumed_run_logs_the_b_simple_of_the_uninterrupted_one(tmp_path):
    """60 windows of the regression problem with a checkpoint at step 30, against the same
    run resumed from it: the noise estimate's state travels with the Trainer's checkpoint
    (it restarted empty: the resumed run logged another b_simple at each later step)."""
    problem = Regression()
    items = [{"x": xi, "y": yi} for xi, yi in zip(problem.x, problem.y, strict=True)]

    def run(folder, steps, resume=None):
        model = problem.model()
        trainer = Trainer(
            model=model,
            args=arguments(
                folder,
                max_steps=steps,
                save_strategy="steps",
                save_steps=30,
                per_device_train_batch_size=16,
                gradient_accumulation_steps=8,
                remove_unused_columns=False,
            ),
            train_dataset=items,
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None),
            loss_fn=lambda model, inputs: problem.loss(model, inputs["x"], inputs["y"]),
            noise=NoiseScale(groups=3),
        )
        trainer.train(resume_from_checkpoint=resume)
        return {e["step"]: e["b_simple"] for e in trainer.state.log_history if "b_simple" in e}

    whole = run(tmp_path / "whole", 60)
    run(tmp_path / "part", 30)
    resumed = run(tmp_path / "part", 60, resume=True)
    assert (tmp_path / "part" / "checkpoint-30" / "gradaccum_noise_0.pt").is_file()
    later = [s for s in whole if s > 30]
    assert len(later) == 30 and all(resumed[s] == pytest.approx(whole[s], rel=1e-9) for s in later)


def test_the_mixin_makes_a_trainer_subclass_exact(tmp_path):
    """A Trainer subclass whose compute_loss returns a per-micro-batch mean (the 4x bug when
    it ignores num_items_in_batch) is exact with ExactAccumulationMixin in front of it."""
    from gradaccum.integrations.transformers import ExactAccumulationMixin

    class MeanLossTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss_sum, count = token_sum_loss(model, inputs)
            return loss_sum / count

    class Exact(ExactAccumulationMixin, MeanLossTrainer):
        pass

    plain = window_errors(tmp_path / "plain", MeanLossTrainer, 16)
    ours = window_errors(tmp_path / "ours", Exact, 16)
    print(f"a subclass's per-micro-batch mean: alone {plain[0]:.2e}, with the mixin {ours[0]:.1e}")
    assert plain[0] > 1e-2 and ours[0] <= 1e-6


def run_with_fault(tmp_path, fault=None, oom=None) -> tuple[list[dict], dict, list[dict]]:
    """Three windows of 16 padded sequences (4 micro-batches of 4) at SGD 0.1: the gradient
    of each step, the final weights and the Trainer's logs. ``fault(model)`` makes the
    device run out of memory partway through."""
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = capture_step_grads(optimizer, model)
    if fault is not None:
        fault(model)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=padded_sequences(48),
        optimizers=(optimizer, None),
        oom=oom,
    )
    trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return seen, weights, trainer.state.log_history


@pytest.mark.parametrize("phase", ["forward", pytest.param("backward", marks=pytest.mark.slow)])
def test_out_of_memory_mid_window_replays_it_to_the_same_step(tmp_path, phase, caplog):
    """The device holds 2 sequences from the 7th micro-batch on (the second window's third):
    its forward (or backward) runs out of memory; the window is replayed at 2 from its first
    micro-batch, the rest of the run at 2. Every step as without the fault."""
    from support.faults import oom_after

    import gradaccum as ga

    clean, clean_weights, _ = run_with_fault(tmp_path / "clean")
    faults = []

    def fault(model):
        faults.append(oom_after(model.transformer.h[0], 6, 2, phase=phase))

    with caplog.at_level("WARNING", logger="gradaccum"):
        seen, weights, logs = run_with_fault(tmp_path / "fault", fault, ga.OOMReplay())
    assert faults[0].faults == 1
    assert len(seen) == len(clean) == 3
    errors = [rel_err(a, b) for a, b in zip(seen, clean, strict=True)]
    drift = rel_err(weights, clean_weights)
    print(f"out of memory in the {phase} mid-window: steps {errors}, weights {drift:.1e}")
    assert max(errors) <= 1e-6 and drift <= 1e-6
    assert "out of memory at micro-batch size 4; replaying the window at 2" in caplog.text
    assert [x.get("oom_replays", 0) for x in logs if "loss" in x] == [0, 1, 1]


def test_out_of_memory_without_replay_ends_training(tmp_path):
    from support.faults import oom_after

    with pytest.raises(torch.OutOfMemoryError):
        run_with_fault(tmp_path, lambda m: oom_after(m.transformer.h[0], 6, 2))


def ramp(start: int, target: int, span: int, unit: int, total: int) -> list[int]:
    """The windows of a linear ramp over ``span`` samples, each batch rounded to whole
    ``unit``s, the last holding what is left of ``total``: worked out here, not by gradaccum."""
    sizes, seen = [], 0
    while seen < total:
        batch = start if seen == 0 else start + (target - start) * min(seen, span) / span
        batch = max(unit, round(batch / unit) * unit) if seen else start
        sizes.append(min(batch, total - seen))
        seen += sizes[-1]
    return sizes


def test_a_batch_schedule_runs_the_ramps_windows_each_exact(tmp_path):
    """A linear ramp from 8 to 32 sequences over the first 64, micro-batches of 4, on 96
    padded sequences: the Trainer steps after each of the ramp's windows (8, 12, 16, 20, 28,
    then the 12 left), and each step's gradient is its window's full-batch mean."""
    import gradaccum as ga

    schedule = ga.BatchSchedule("linear:64=32", start=8, unit=4)
    reference, items, seen, trainer = train_at_lr0(tmp_path, 96, schedule=schedule)
    want = ramp(8, 32, 64, 4, 96)
    logged = [x["effective_batch"] for x in trainer.state.log_history if "loss" in x]
    assert logged == want and len(seen) == len(want)
    edges = [sum(want[:i]) for i in range(len(want) + 1)]
    errors = [
        rel_err(grads, full_batch_grads(reference, items[a:b]))
        for grads, a, b in zip(seen, edges[:-1], edges[1:], strict=True)
    ]
    print(f"the ramp's windows {want}: errors {max(errors):.1e} at most")
    assert max(errors) <= 1e-6


def accumulator_auto_windows(problem, n: int, micro: int) -> list[int]:
    """gradaccum's own loop with the same auto schedule on the same samples: its windows."""
    import gradaccum as ga

    model = problem.model()
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise=problem.noise())
    schedule = ga.BatchSchedule("auto", start=8, unit=micro, maximum=64)
    sizes = []
    while schedule.samples < n:
        size = min(schedule.size(), n - schedule.samples)
        a = schedule.samples
        window = (problem.x[a : a + size], problem.y[a : a + size])
        result = acc.step(ga.split(window, micro), lambda m, mb: problem.loss(m, *mb))
        schedule.update(result, size)
        sizes.append(size)
    return sizes


@pytest.mark.slow  # 4,096 samples in windows of 8 to 20
def test_the_auto_schedule_raises_the_batch_as_gradaccums_own_loop_does(tmp_path):
    """The regression problem with a known B_simple (about 46 samples): auto from 8 samples
    (2 micro-batches of 4), at most 64, over 4,096 samples. The Trainer's windows are the
    ones gradaccum's own loop takes on the same samples (one arithmetic), the batch rises
    above 8, and every window's gradient is its samples' full-batch mean."""
    import gradaccum as ga

    problem, n = Regression(windows=32), 4096
    items = [{"x": xi, "y": yi} for xi, yi in zip(problem.x, problem.y, strict=True)]
    model = problem.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, remove_unused_columns=False),
        train_dataset=items,
        optimizers=(optimizer, None),
        loss_fn=lambda m, inputs: problem.loss(m, inputs["x"], inputs["y"]),
        noise=problem.noise(),
        schedule=ga.BatchSchedule("auto", start=8, unit=4, maximum=64),
    )
    trainer.train()
    sizes = [x["effective_batch"] for x in trainer.state.log_history if "loss" in x]
    assert sizes == accumulator_auto_windows(problem, n, 4)
    assert sum(sizes) == n and max(sizes) > 8
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    reference = problem.model()
    errors = []
    for grads, a, b in zip(seen, edges[:-1], edges[1:], strict=True):
        reference.zero_grad()
        (0.5 * (reference(problem.x[a:b]).squeeze(1) - problem.y[a:b]) ** 2).mean().backward()
        errors.append(rel_err(grads, {"weight": reference.weight.grad}))
    print(f"auto: {len(sizes)} windows of {sorted(set(sizes))}, errors {max(errors):.1e} at most")
    assert max(errors) <= 1e-6


def test_resuming_a_scheduled_run_is_refused_in_one_line(tmp_path):
    import gradaccum as ga

    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp_path),
        train_dataset=padded_sequences(16),
        schedule=ga.BatchSchedule("linear:64=32", start=8, unit=4),
    )
    with pytest.raises(ValueError, match="resuming a run with schedule= is not supported") as err:
        trainer.train(resume_from_checkpoint=str(tmp_path))
    assert "\n" not in str(err.value)


def test_items_keeps_a_trainers_own_mean_over_examples(tmp_path):
    """A Trainer whose own loss is a mean over its micro-batch's examples (here each
    sequence's token mean, averaged over the sequences), kept as it is with ``items=``
    counting the sequences: each window is the mean over its 16 sequences of their token
    means, written with torch alone; 28 sequences make a ragged last window of 12."""
    import torch.nn.functional as F

    from gradaccum.integrations.transformers import ExactAccumulationMixin

    def per_sequence_means(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        losses = F.cross_entropy(
            logits[:, :-1].transpose(1, 2).float(), labels, ignore_index=-100, reduction="none"
        )
        return losses.sum(1) / labels.ne(-100).sum(1)

    class SequenceMeanTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return per_sequence_means(model, inputs).mean()

    class Exact(ExactAccumulationMixin, SequenceMeanTrainer):
        pass

    count = lambda inputs: len(inputs["input_ids"])  # noqa: E731
    reference, items, seen, _ = train_at_lr0(tmp_path, 28, Exact, items=count)
    errors = []
    for w, grads in enumerate(seen):
        reference.zero_grad()
        window = stack(items[16 * w : 16 * w + 16])
        per_sequence_means(reference, window).mean().backward()
        want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        errors.append(rel_err(grads, want))
    print(f"items= over a mean of sequence means: windows {errors}")
    assert len(seen) == 2 and max(errors) <= 1e-6
