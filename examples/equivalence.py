"""Is the accumulated gradient the large batch's gradient? Measure it.

    python examples/equivalence.py

A byte-level GPT reads variable-length lines of the Python standard library's source,
padded in a batch of 32. The same batch is run three ways and their gradients compared:

  full batch   one forward/backward over all 32 sequences (the reference)
  naive        8 micro-batches, mean loss of each divided by 8 (the common recipe)
  gradaccum    8 micro-batches through ga.Accumulator ((sum, count) losses)

Then it trains 40 windows with gradaccum so you can watch the loss fall.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.app.recipes.stdlib_text import corpus_bytes, padded_lines_batch

BATCH, MICRO, SEQ = 32, 4, 96


def model_at(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(max_len=SEQ, d_model=64, n_heads=4, n_layers=2))


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def full_batch_gradient(batch) -> torch.Tensor:
    model = model_at(0)
    logits = model(batch["input_ids"])[:, :-1]
    F.cross_entropy(logits.reshape(-1, 256), batch["labels"][:, 1:].reshape(-1)).backward()
    return flat_grad(model)


def naive_gradient(micro_batches) -> torch.Tensor:
    model = model_at(0)
    for mb in micro_batches:
        logits = model(mb["input_ids"])[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, 256), mb["labels"][:, 1:].reshape(-1))
        (loss / len(micro_batches)).backward()
    return flat_grad(model)


def lm_loss(model, mb):
    return ga.causal_lm_loss(model(mb["input_ids"]), mb["labels"])


def gradaccum_gradient(micro_batches) -> torch.Tensor:
    model = model_at(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(flat_grad(model).clone()))
    ga.Accumulator(model, optimizer).step(micro_batches, lm_loss)
    return seen[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    data = corpus_bytes()
    gen = torch.Generator().manual_seed(0)
    batch = padded_lines_batch(data, BATCH, SEQ, gen)
    # Sort by length so micro-batches differ in token count, as bucketed loaders do.
    order = (batch["labels"] != -100).sum(1).argsort()
    batch = {k: v[order] for k, v in batch.items()}
    micro = ga.split(batch, MICRO)
    tokens = [int((mb["labels"][:, 1:] != -100).sum()) for mb in micro]

    print(f"gradaccum demo: byte GPT on {len(data) / 1e6:.1f} MB of Python stdlib source")
    print(f"one batch of {BATCH} padded sequences, {len(micro)} micro-batches of {MICRO}")
    print(f"tokens that count per micro-batch: {tokens}\n")
    reference = full_batch_gradient(batch)
    naive = naive_gradient(micro)
    ours = gradaccum_gradient(micro)
    print("| method                          | gradient error vs full batch |")
    print("|---------------------------------|------------------------------|")
    print(f"| naive: mean per micro-batch / N | {rel(naive, reference):28.2e} |")
    print(f"| gradaccum: (sum, count)         | {rel(ours, reference):28.2e} |")

    print("\ntraining 40 windows of 8 micro-batches (effective batch 32 sequences):")
    model = model_at(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    acc = ga.Accumulator(model, optimizer, max_grad_norm=1.0)
    start = time.perf_counter()
    for step in range(1, 41):
        window = ga.split(padded_lines_batch(data, BATCH, SEQ, gen), MICRO)
        result = acc.step(window, lm_loss)
        if step == 1 or step % 10 == 0:
            print(
                f"  step {step:2d}  loss {result.loss:.3f}  tokens {result.count:5d}  "
                f"grad norm {result.grad_norm:.3f}"
            )
    print(f"done in {time.perf_counter() - start:.1f} s; {acc.state}")


if __name__ == "__main__":
    main()
