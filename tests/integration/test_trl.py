"""TRL's SFTTrainer (prompt/completion data, completion-only labels, padded micro-batches), as
shipped and with gradaccum's ExactAccumulationMixin in front of it, each audited by ga.audit
(one window against the same samples as one batch under SFTTrainer's own loss); and the
mixin's window against the full batch computed with torch alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from frameworks import rel_err, tiny_gpt2
from helpers import capture_step_grads

import gradaccum as ga

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
from gradaccum.integrations.transformers import ExactAccumulationMixin  # noqa: E402


def tokenizer(words: int = 250):
    """A word-level tokenizer over the words w0..w{words - 1}, built here (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def prompts_and_completions(n: int = 16):
    """Prompts of 2-11 words and completions of 1-19: every micro-batch counts a different
    number of completion tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        lengths = [
            int(torch.randint(2, 12, (1,), generator=g)),
            int(torch.randint(1, 20, (1,), generator=g)),
        ]
        words = [
            " ".join(f"w{int(t)}" for t in torch.randint(0, 250, (k,), generator=g))
            for k in lengths
        ]
        rows.append({"prompt": words[0], "completion": words[1]})
    return datasets.Dataset.from_list(rows)


def config(out, **overrides):
    return trl.SFTConfig(
        **overrides,
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=64,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )


def test_sft_trainer_as_shipped_is_audited(tmp_path):
    trainer = trl.SFTTrainer(
        model=tiny_gpt2(),
        args=config(tmp_path),
        train_dataset=prompts_and_completions(),
        processing_class=tokenizer(),
    )
    result = ga.audit(trainer)
    print(f"TRL {trl.__version__} SFTTrainer as shipped: {result.summary}")
    assert result.passed  # measured: TRL's SFTTrainer divides by the window's tokens


class ExactSFT(ExactAccumulationMixin, trl.SFTTrainer):
    pass


def test_the_mixin_over_sft_trainer_passes_the_audit(tmp_path):
    """ExactAccumulationMixin in front of SFTTrainer: the window (the mixin's own sum and
    count) against the same 16 sequences as one batch under SFTTrainer's own loss."""
    trainer = ExactSFT(
        model=tiny_gpt2(),
        args=config(tmp_path),
        train_dataset=prompts_and_completions(),
        processing_class=tokenizer(),
    )
    result = ga.audit(trainer, tolerance=1e-6)
    print(f"ExactAccumulationMixin over TRL's SFTTrainer: {result.summary}")
    assert result.passed


def window_and_reference(trainer_class, folder) -> tuple[dict, dict]:
    """One window of 4 micro-batches of 4 through ``trainer_class`` in fp32 (TRL's SFTConfig
    trains in bf16 by default), and one backward of the same 16 sequences' mean over their
    completion tokens (the collator's labels: prompt and padding are -100), written with
    torch alone."""
    model, reference = tiny_gpt2(), tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = trainer_class(
        model=model,
        args=config(folder, bf16=False),
        train_dataset=prompts_and_completions(),
        processing_class=tokenizer(),
        optimizers=(optimizer, None),
    )
    batches = list(trainer.get_train_dataloader())
    trainer.train()
    assert len(seen) == 1 and len(batches) == 4
    logits, labels = [], []
    for b in batches:
        out = reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        logits.append(out[:, :-1].reshape(-1, out.shape[-1]))
        labels.append(b["labels"][:, 1:].reshape(-1))
    prompt_or_padding = sum(int((b["labels"] == -100).sum()) for b in batches)
    assert prompt_or_padding > 0  # completion-only labels: the prompts are not counted
    F.cross_entropy(torch.cat(logits), torch.cat(labels), ignore_index=-100).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    return seen[0], want


def test_the_mixin_over_sft_trainer_gives_the_full_batch_gradient(tmp_path):
    ours = rel_err(*window_and_reference(ExactSFT, tmp_path / "ours"))
    shipped = rel_err(*window_and_reference(trl.SFTTrainer, tmp_path / "shipped"))
    print(f"TRL's SFTTrainer in fp32: with the mixin {ours:.1e}, as shipped {shipped:.1e}")
    assert ours <= 1e-6


def preference_pairs(n: int = 14):
    """Prompts of 2-9 words, chosen and rejected completions of 1-14: 14 pairs in micro-
    batches of 4 make one window of 4, 4, 4 and 2 pairs."""
    g = torch.Generator().manual_seed(1)

    def words(low, high):
        k = int(torch.randint(low, high, (1,), generator=g))
        return " ".join(f"w{int(t)}" for t in torch.randint(0, 250, (k,), generator=g))

    rows = [
        {"prompt": words(2, 10), "chosen": " " + words(1, 15), "rejected": " " + words(1, 15)}
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


class ExactDPO(ExactAccumulationMixin, trl.DPOTrainer):
    pass


def completion_logps(model, batch) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens, with torch alone."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    taken = logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (taken * batch["completion_mask"][:, 1:]).sum(dim=1)


def dpo_trainer(trainer_class, folder, model=None, optimizers=(None, None), **overrides):
    """``trainer_class`` on the 14 preference pairs, micro-batches of 4, 4 of them a window,
    in fp32, with a tiny GPT-2 (``model``) and an identical reference model."""
    args = trl.DPOConfig(
        **overrides,
        output_dir=str(folder),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=64,
        bf16=False,
        disable_tqdm=True,
    )
    return trainer_class(
        model=model if model is not None else tiny_gpt2(),
        ref_model=tiny_gpt2(),
        args=args,
        train_dataset=preference_pairs(),
        processing_class=tokenizer(),
        optimizers=optimizers,
    )


def dpo_window_and_reference(trainer_class, folder, **overrides) -> tuple[dict, dict]:
    """One window of 14 pairs (4, 4, 4, 2) through ``trainer_class``, and one backward of
    the same pairs' mean DPO loss (sigmoid, beta 0.1: -log sigmoid(beta * (chosen's log
    ratio - rejected's))) written with torch alone."""
    model, reference, frozen = tiny_gpt2(), tiny_gpt2(), tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    trainer = dpo_trainer(trainer_class, folder, model, optimizers=(optimizer, None), **overrides)
    batches = list(trainer.get_train_dataloader())
    trainer.train()
    assert len(seen) == 1 and [len(b["input_ids"]) // 2 for b in batches] == [4, 4, 4, 2]
    margins = []
    for b in batches:
        with torch.no_grad():
            ref_chosen, ref_rejected = completion_logps(frozen, b).chunk(2)
        chosen, rejected = completion_logps(reference, b).chunk(2)
        margins.append((chosen - ref_chosen) - (rejected - ref_rejected))
    (-F.logsigmoid(0.1 * torch.cat(margins))).mean().backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    return seen[0], want


def test_the_mixin_over_dpo_trainer_gives_the_full_batch_gradient(tmp_path):
    """DPO's loss is a mean over a micro-batch's preference pairs: the mixin takes it times
    the pairs (found by itself for DPOTrainer). As shipped, the Trainer averages the four
    micro-batches' means, weighting the last window's 2 pairs as much as 4."""
    ours = rel_err(*dpo_window_and_reference(ExactDPO, tmp_path / "ours"))
    shipped = rel_err(*dpo_window_and_reference(trl.DPOTrainer, tmp_path / "shipped"))
    print(f"TRL DPOTrainer, 14 pairs as 4+4+4+2: mixin {ours:.1e}, as shipped {shipped:.1e}")
    assert ours <= 1e-6
    assert shipped > 1e-3  # the reference can tell the two apart


def test_the_mixin_refuses_a_dpo_loss_that_is_not_per_pair(tmp_path):
    with pytest.raises(ValueError, match="loss_type sft is not one value per preference pair"):
        dpo_window_and_reference(
            ExactDPO, tmp_path, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0]
        )


class ExactGRPO(ExactAccumulationMixin, trl.GRPOTrainer):
    pass


def recording(trainer_class):
    """``trainer_class`` recording the inputs each training micro-batch's loss was computed
    on (the completions TRL generated, their advantages and masks)."""

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                self.seen_inputs.append({k: v for k, v in inputs.items() if torch.is_tensor(v)})
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def grpo_window_and_reference(trainer_class, folder, loss_type) -> tuple[dict, dict]:
    """One window of GRPO: 4 prompts, 4 completions each (up to 8 tokens, sampled), rewarded
    by their length, in 4 micro-batches of 4 completions. The reference: the same
    completions' loss over the whole window with torch alone (at the step's weights the
    clipped ratio is 1 and its gradient is -advantage times the log-probability's): dapo
    and bnpo a mean over every completion token of the window, grpo the mean over the
    window's completions of each one's token mean."""
    model, reference = tiny_gpt2(), tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    g = torch.Generator().manual_seed(2)
    prompts = [
        {"prompt": " ".join(f"w{int(t)}" for t in torch.randint(0, 254, (k,), generator=g))}
        for k in (3, 5, 7, 9)
    ]
    args = trl.GRPOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=8,
        loss_type=loss_type,
        num_train_epochs=1,
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        disable_tqdm=True,
        seed=3,
    )
    trainer = recording(trainer_class)(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer(254),
    )
    trainer.seen_inputs = []
    trainer.optimizer = optimizer
    trainer.train()
    assert len(seen) == 1 and len(trainer.seen_inputs) == 4
    sums, counts = [], []
    for b in trainer.seen_inputs:
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
        attention = torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1)
        width = b["completion_ids"].shape[1]
        logits = reference(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, b["completion_ids"][..., None])
        per_token = -b["advantages"][:, None] * logp.squeeze(-1)
        mask = b["completion_mask"].float()
        if loss_type == "grpo":
            sums.append(((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum())
            counts.append(len(mask))
        else:
            sums.append((per_token * mask).sum())
            counts.append(mask.sum())
    assert len({int(m["completion_mask"].sum()) for m in trainer.seen_inputs}) > 1
    (sum(sums) / sum(counts)).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    return seen[0], want


@pytest.mark.parametrize(
    "loss_type",
    [
        "bnpo",
        pytest.param("dapo", marks=pytest.mark.slow),
        pytest.param("grpo", marks=pytest.mark.slow),
    ],
)
def test_the_mixin_over_grpo_trainer_normalizes_over_the_window(tmp_path, loss_type):
    """The mixin computes GRPOTrainer's loss through gradaccum's normalizations over the
    window (bnpo and dapo: per_token; grpo: per_sequence). As shipped, bnpo averages each
    micro-batch's own tokens, weighting a micro-batch of short completions as much as one of
    long ones; dapo and grpo are measured too."""
    ours = rel_err(*grpo_window_and_reference(ExactGRPO, tmp_path / "ours", loss_type))
    shipped = rel_err(*grpo_window_and_reference(trl.GRPOTrainer, tmp_path / "shipped", loss_type))
    print(f"TRL GRPOTrainer loss_type={loss_type}: mixin {ours:.1e}, as shipped {shipped:.1e}")
    assert ours <= 1e-6
    if loss_type == "bnpo":
        assert shipped > 1e-3  # the reference tells them apart


def test_the_mixin_refuses_a_grpo_loss_it_does_not_compute(tmp_path):
    with pytest.raises(ValueError, match="GRPO loss_type 'cispo': the mixin computes"):
        grpo_window_and_reference(ExactGRPO, tmp_path, "cispo")


def test_dpo_trainer_is_audited_pair_by_pair(tmp_path):
    """The audit's large batch keeps DPOTrainer's layout (every chosen row, then every
    rejected row): as shipped it reports the error the direct measurement finds, with the
    mixin it passes."""
    shipped = ga.audit(dpo_trainer(trl.DPOTrainer, tmp_path / "shipped"))
    ours = ga.audit(dpo_trainer(ExactDPO, tmp_path / "ours"), tolerance=1e-6)
    print(f"audit of TRL's DPOTrainer: as shipped {shipped.summary}; with the mixin {ours.summary}")
    direct = rel_err(*dpo_window_and_reference(trl.DPOTrainer, tmp_path / "direct"))
    assert not shipped.passed and shipped.relative_error == pytest.approx(direct, rel=0.05)
    assert "ExactAccumulationMixin, DPOTrainer" in shipped.fix and "items=" not in shipped.fix
    assert ours.passed


def test_grpo_trainer_audit_is_refused_in_one_line(tmp_path):
    trainer = trl.GRPOTrainer(
        model=tiny_gpt2(),
        reward_funcs=lambda completions, **kwargs: [0.0 for _ in completions],
        args=trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False),
        train_dataset=datasets.Dataset.from_list([{"prompt": "w1 w2"}] * 8),
        processing_class=tokenizer(254),
    )
    with pytest.raises(TypeError, match="audit of a GRPOTrainer: its micro-batches are"):
        ga.audit(trainer)
