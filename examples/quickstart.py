import torch
import torch.nn.functional as F

import gradaccum as ga

model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = ga.Accumulator(model, optimizer, max_grad_norm=1.0)


def loss_fn(model, micro_batch):  # -> (loss summed over the items, number of items)
    x, y = micro_batch
    return ga.sample_mean(F.cross_entropy(model(x), y, reduction="none"))


for _ in range(10):
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()  # the batch the recipe wants
    result = acc.step(ga.split((x, y), 32), loss_fn)  # 8 micro-batches, one optimizer step
    print(f"step {result.step}  loss {result.loss:.3f}  grad norm {result.grad_norm:.3f}")
