"""gradaccum's Accumulator on the model and optimizer that Accelerate prepares (DDP).

Each rank takes its share of every global batch and runs it as micro-batches; the
Accumulator reduces gradients once per window and divides by the global token count, so
ranks holding different numbers of tokens still take the full batch's step. At the end,
rank 0 replays the same steps in one process with the whole batch and prints the largest
difference between the two models' parameters.

    pip install 'gradaccum[transformers]'   # accelerate comes with it
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py
"""

import copy

import torch
from accelerate import Accelerator

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.app.recipes.stdlib_text import corpus_bytes, padded_lines_batch

STEPS, BATCH, MICRO = 3, 32, 4

torch.manual_seed(0)
model = GPT(GPTConfig(max_len=64, d_model=64, n_heads=4, n_layers=2))
start = copy.deepcopy(model.state_dict())
data = corpus_bytes()
batches = [
    padded_lines_batch(data, BATCH, 64, torch.Generator().manual_seed(step))
    for step in range(STEPS)
]

accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
acc = ga.Accumulator(model, optimizer)


def loss_fn(model, micro_batch):  # (cross-entropy summed over the counted tokens, count)
    return ga.causal_lm_loss(model(micro_batch["input_ids"]), micro_batch["labels"])


for step, batch in enumerate(batches):
    mine = ga.shard(batch, accelerator.process_index, accelerator.num_processes)
    result = acc.step(ga.split(mine, MICRO), loss_fn)
    accelerator.print(f"step {step + 1}  loss {result.loss:.4f} over {result.count} tokens")

if accelerator.is_main_process:
    one = GPT(GPTConfig(max_len=64, d_model=64, n_heads=4, n_layers=2))
    one.load_state_dict(start)
    sgd = torch.optim.SGD(one.parameters(), lr=0.5)
    for batch in batches:  # the whole batch, one backward: what every step should equal
        sgd.zero_grad()
        loss_sum, count = ga.causal_lm_loss(one(batch["input_ids"]), batch["labels"])
        (loss_sum / count).backward()
        sgd.step()
    trained = accelerator.unwrap_model(model)
    diff = max(
        float((p - q).detach().abs().max())
        for p, q in zip(trained.parameters(), one.parameters(), strict=True)
    )
    print(f"largest parameter difference against one process's full batch: {diff:.1e}")
accelerator.wait_for_everyone()
accelerator.end_training()
