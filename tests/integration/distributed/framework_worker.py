"""One rank of a torchrun job: 3 SGD steps of the tiny GPT-2 through a framework with
gradaccum's integration, 2 ranks x 4 micro-batches of 4 padded sequences per step. Rank 0
saves the parameters to argv[2]. Run by test_frameworks_torchrun.py."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from frameworks import padded_sequences, stack, tiny_gpt2, token_sum_loss  # noqa: E402

ITEMS, LR = 96, 0.1


def transformers_run() -> torch.nn.Module:
    import transformers

    from gradaccum.integrations.transformers import Trainer

    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        max_grad_norm=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=padded_sequences(ITEMS),
        optimizers=(optimizer, None),
    )
    trainer.train()
    assert trainer.state.global_step == 3, trainer.state.global_step
    return model


def lightning_run() -> torch.nn.Module:
    import lightning

    from gradaccum.integrations.lightning import ExactAccumulation, exact_output

    class LM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            return exact_output(self, *token_sum_loss(self.model, batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=LR)

    module = LM()
    # Rank r takes items r, r + 2, ...: each step covers 32 consecutive items, as in the
    # reference (Lightning's own distributed sampler shuffles here).
    items = padded_sequences(ITEMS)
    sampler = torch.utils.data.DistributedSampler(
        items, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False
    )
    loader = torch.utils.data.DataLoader(items, batch_size=4, sampler=sampler, collate_fn=stack)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        accumulate_grad_batches=4,
        callbacks=[ExactAccumulation()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, loader)
    assert trainer.global_step == 3, trainer.global_step
    return module.model


if __name__ == "__main__":
    torch.set_num_threads(1)
    model = {"transformers": transformers_run, "lightning": lightning_run}[sys.argv[1]]()
    if dist.is_initialized():
        if dist.get_rank() == 0:
            torch.save({n: p.detach() for n, p in model.named_parameters()}, sys.argv[2])
        # As in launch.py: free the frameworks' reference cycles (the DDP reducer among them)
        # while the group still lives, pass the last collective together, tear the group
        # down, and leave without the interpreter's finalization, where gloo's worker
        # threads could still hold work ("terminate called without an active exception",
        # pytorch/pytorch#179291; seen once in CI after the results were written).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
