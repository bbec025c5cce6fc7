"""Lightning's accumulate_grad_batches made exact: one callback, and training_step returns its
summed loss and item count through exact_output.

A small byte-level GPT learns Python's standard-library source from padded lines of very
different lengths, 4 micro-batches of 4 per optimizer step. First one window's gradient
with the plain recipe (a mean loss per micro-batch) and with the callback against one
full-batch backward, then 30 steps of training.

    pip install 'gradaccum[lightning]'
    python examples/lightning_trainer.py
"""

import copy

import lightning
import torch

import gradaccum as ga
from gradaccum.app.recipes.gpt import GPT, GPTConfig
from gradaccum.app.recipes.stdlib_text import corpus_bytes, padded_lines_batch
from gradaccum.integrations.lightning import ExactAccumulation, exact_output


class LM(lightning.LightningModule):
    def __init__(self, model: torch.nn.Module, exact: bool, lr: float) -> None:
        super().__init__()
        self.model, self.exact, self.lr = model, exact, lr
        self.seen = []  # the gradient each optimizer step is handed

    def training_step(self, batch, batch_idx):
        loss_sum, count = ga.causal_lm_loss(self.model(batch["input_ids"]), batch["labels"])
        if self.exact:
            return exact_output(self, loss_sum, count)
        return loss_sum / count  # the usual recipe: each micro-batch's own mean

    def on_before_optimizer_step(self, optimizer):  # after the callback's division
        self.seen.append([p.grad.clone() for p in self.model.parameters()])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def fit(module: LM, steps: int, log_every: int = 0) -> None:
    callbacks = [ExactAccumulation()] if module.exact else []
    if log_every:
        callbacks.append(Progress(callbacks[0], log_every))  # after it: it reads its numbers
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=4,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))


class Progress(lightning.Callback):
    """Prints the window's exact mean loss and B_simple, as ExactAccumulation measured them."""

    def __init__(self, exact: ExactAccumulation, every: int) -> None:
        self.exact, self.every = exact, every

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step, last = trainer.global_step + 1, self.exact.last
        if step % self.every == 0:
            noise = f"  B_simple {last.b_simple:,.0f}" if last.b_simple is not None else ""
            print(f"step {step}  loss {last.loss:.3f} nats/token{noise}")


def relative_error(got, want) -> float:
    num = sum(float((g - w).double().square().sum()) for g, w in zip(got, want, strict=True))
    return (num / sum(float(w.double().square().sum()) for w in want)) ** 0.5


torch.manual_seed(0)
batch = padded_lines_batch(corpus_bytes(), 480, 64, torch.Generator().manual_seed(0))
data = [{k: v[i] for k, v in batch.items()} for i in range(480)]
start = GPT(GPTConfig(max_len=64, d_model=64, n_heads=4, n_layers=2))

reference = copy.deepcopy(start)
loss_sum, count = ga.causal_lm_loss(reference(batch["input_ids"][:16]), batch["labels"][:16])
(loss_sum / count).backward()
full = [p.grad for p in reference.parameters()]

print("relative gradient error of one window against the full batch:")
for exact, name in ((False, "mean per micro-batch"), (True, "ExactAccumulation")):
    module = LM(copy.deepcopy(start), exact, lr=0.0)
    fit(module, steps=1)
    print(f"  {name:22s} {relative_error(module.seen[0], full):.1e}")

fit(LM(copy.deepcopy(start), exact=True, lr=3e-3), steps=30, log_every=10)
