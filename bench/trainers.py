"""The frameworks' own Trainers, plain and with gradaccum's integrations, for
bench/correctness.py: Hugging Face's Trainer (``gradient_accumulation_steps=4``) and
Lightning's Trainer (``accumulate_grad_batches=4``, a mean loss per micro-batch as its docs
show) on a tiny GPT-2 (2 layers, d 64, vocabulary 256) and right-padded sequences of
lengths 4..64, micro-batches of 4. Each returns the gradient every optimizer step applied,
recorded by the optimizer itself after any closure ran, clipping off."""

from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F

SEQ, VOCAB, MICRO, N = 64, 256, 4, 4


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        )
    )


def sequences(n: int, sort: bool) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of lengths spread over 4..64 in random order (or sorted by length, as
    bucketing loaders do), right-padded, padding labelled -100."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(4, SEQ, n).round().long()
    lengths = lengths if sort else lengths[torch.randperm(n, generator=g)]
    items = []
    for length in lengths.tolist():
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        labels = torch.full((SEQ,), -100, dtype=torch.long)
        labels[:length] = ids[:length]
        items.append(
            {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}
        )
    return items


def stack(items):
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def token_sum(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def full_batch(items) -> dict[str, torch.Tensor]:
    model = tiny_gpt2()
    loss, count = token_sum(model, stack(items))
    (loss / count).backward()
    return {n: p.grad for n, p in model.named_parameters()}


class Recording(torch.optim.SGD):
    def __init__(self, model, names_prefix: str = "") -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.names = {id(p): names_prefix + n for n, p in model.named_parameters()}
        self.seen: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.seen.append(
            {
                self.names[id(p)]: p.grad.detach().clone()
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        )
        super().step()
        return loss


def hf(items, exact: bool) -> list[dict]:
    import transformers

    from gradaccum.integrations.transformers import Trainer

    model = tiny_gpt2()
    optimizer = Recording(model)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=N,
        num_train_epochs=1,
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        log_level="error",
    )
    cls = Trainer if exact else transformers.Trainer
    cls(model=model, args=args, train_dataset=items, optimizers=(optimizer, None)).train()
    return optimizer.seen


def lightning_trainer(items, exact: bool) -> list[dict]:
    import lightning

    from gradaccum.integrations.lightning import ExactAccumulation, exact_output

    class LM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            loss_sum, count = token_sum(self.model, batch)
            return exact_output(self, loss_sum, count) if exact else loss_sum / count

        def configure_optimizers(self):
            self.optimizer = Recording(self.model)
            return self.optimizer

    module = LM()
    lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=N,
        callbacks=[ExactAccumulation()] if exact else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, torch.utils.data.DataLoader(items, batch_size=MICRO, collate_fn=stack))
    return module.optimizer.seen


WAYS = {
    "Hugging Face Trainer": lambda items: hf(items, exact=False),
    "Hugging Face Trainer + gradaccum Trainer": lambda items: hf(items, exact=True),
    "Lightning Trainer (mean per micro-batch)": lambda items: lightning_trainer(items, False),
    "Lightning Trainer + ExactAccumulation": lambda items: lightning_trainer(items, True),
}


def rows(rel) -> list[tuple[str, float, float, float]]:
    """Per way: the relative error of a full window (random order, length-sorted) and of the
    ragged last window (28 sequences: 7 micro-batches in windows of 4)."""
    shuffled, ordered = sequences(16, sort=False), sequences(16, sort=True)
    ragged = sequences(28, sort=False)
    want = [full_batch(shuffled), full_batch(ordered), full_batch(ragged[16:])]
    out = []
    for name, way in WAYS.items():
        got = [way(shuffled)[0], way(ordered)[0], way(ragged)[1]]
        errors = [rel(g, w) for g, w in zip(got, want, strict=True)]
        print(f"{name}: " + ", ".join(f"{e:.2e}" for e in errors), flush=True)
        out.append((name, *errors))
    return out
