"""One rank of a torchrun job: 3 SGD steps of test_moe.py's tiny Qwen3-MoE, its router loss
on, through gradaccum's Trainer, 2 ranks x 4 micro-batches of 4 sequences per step (each
rank's routing is its own: the window's expert shares are summed over both). Rank 0 saves
the parameters to argv[1]. Run by test_moe.py."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]  # tests/, tests/integration/
from test_moe import sequences, tiny_moe  # noqa: E402

ITEMS, LR = 96, 0.1


def run() -> torch.nn.Module:
    import transformers

    from gradaccum.integrations.transformers import Trainer

    model = tiny_moe()
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
        model=model, args=args, train_dataset=sequences(ITEMS), optimizers=(optimizer, None)
    )
    trainer.train()
    assert trainer.state.global_step == 3, trainer.state.global_step
    return model


if __name__ == "__main__":
    torch.set_num_threads(1)
    model = run()
    if dist.get_rank() == 0:
        torch.save({n: p.detach() for n, p in model.named_parameters()}, sys.argv[1])
    # as framework_worker.py leaves: cycles freed, the last collective together, no
    # interpreter finalization while gloo's threads may hold work
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
