"""Hugging Face's Trainer with exact gradient accumulation: swap one import.

A tiny GPT-2 (byte vocabulary) learns Python's standard-library source from padded lines of
very different lengths, 4 micro-batches of 4 per optimizer step. First one window's gradient
from each Trainer against one full-batch backward, then 30 steps of training.

    pip install 'gradaccum[transformers]'
    python examples/transformers_trainer.py
"""

import copy
import tempfile

import torch
import torch.nn.functional as F
import transformers

from gradaccum.app.recipes.stdlib_text import corpus_bytes, padded_lines_batch
from gradaccum.integrations.transformers import Trainer

torch.manual_seed(0)
# (dropout off, so that the two Trainers and the reference compute the same forward)
config = transformers.GPT2Config(
    vocab_size=256,
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
batch = padded_lines_batch(corpus_bytes(), 480, 64, torch.Generator().manual_seed(0))
batch["attention_mask"] = (batch["labels"] != -100).long()
data = [{k: v[i] for k, v in batch.items()} for i in range(480)]


def arguments(**overrides):
    settings = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def first_window_gradient(trainer_class) -> list[torch.Tensor]:
    """The gradient the optimizer is handed at the first step (clipping off)."""
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.clone() for p in model.parameters()])
    )
    args = arguments(max_steps=1, max_grad_norm=0.0)
    trainer_class(model=model, args=args, train_dataset=data, optimizers=(optimizer, None)).train()
    return seen[0]


def relative_error(got, want) -> float:
    num = sum(float((g - w).double().square().sum()) for g, w in zip(got, want, strict=True))
    return (num / sum(float(w.double().square().sum()) for w in want)) ** 0.5


start = copy.deepcopy(transformers.GPT2LMHeadModel(config).state_dict())
reference = transformers.GPT2LMHeadModel(config)
reference.load_state_dict(start)
window = {k: v[:16] for k, v in batch.items()}
logits = reference(input_ids=window["input_ids"], attention_mask=window["attention_mask"]).logits
F.cross_entropy(logits[:, :-1].reshape(-1, 256), window["labels"][:, 1:].reshape(-1)).backward()
full = [p.grad for p in reference.parameters()]

print("relative gradient error of one window against the full batch:")
plain = relative_error(first_window_gradient(transformers.Trainer), full)
ours = relative_error(first_window_gradient(Trainer), full)
print(f"  transformers.Trainer   {plain:.1e}")
print(f"  gradaccum's Trainer    {ours:.1e}")

model = transformers.GPT2LMHeadModel(config)
trainer = Trainer(model=model, args=arguments(max_steps=30, logging_steps=10), train_dataset=data)
trainer.train()
for entry in trainer.state.log_history:
    if "loss" in entry:
        b = entry.get("b_simple")
        noise = f"  B_simple {b:,.0f}" if b is not None else ""
        print(f"step {entry['step']}  loss {entry['loss']:.3f} nats/token{noise}")
