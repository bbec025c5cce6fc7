"""TRL's SFTTrainer (prompt/completion data, completion-only labels, padded micro-batches), as
shipped and with gradaccum's ExactAccumulationMixin in front of it, each audited by ga.audit:
one window against the same samples as one batch under SFTTrainer's own loss."""

from __future__ import annotations

import pytest
import torch
from frameworks import tiny_gpt2

import gradaccum as ga

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
from gradaccum.integrations.transformers import ExactAccumulationMixin  # noqa: E402


def tokenizer():
    """A word-level tokenizer over the words w0..w249, built here (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(250)}}
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


def config(out):
    return trl.SFTConfig(
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
