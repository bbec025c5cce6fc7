"""A real DeepSpeed engine's live tensor bytes on this CPU, to check the estimate's model of
ZeRO stages 1 and 2 against (test_zero_estimate_against_real.py): one process (world
size 1, gloo on 127.0.0.1) or each of torchrun's, the GPT-shaped ``estimate_worker.Net`` given to
``deepspeed.initialize`` with a configuration dict, two windows of ``engine.backward`` and
``engine.step`` as Hugging Face's Trainer drives them, measured by
``support.live_tensors.LiveBytes`` from before the model is built (no code of the estimate).

    python zero_worker.py CONFIG_JSON MICRO_SIZE MICRO_BATCHES PORT   (tests/ on PYTHONPATH)

prints ``{"rank": r, "peak": bytes, "optimizer": class name}``, one line per process."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch


def main(config: dict, micro_size: int, micro_batches: int, port: int) -> dict:
    if "RANK" not in os.environ:  # one process, not started by torchrun
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
            LOCAL_RANK="0",
        )  # fmt: skip
    import deepspeed
    import estimate_worker as worker
    from support.live_tensors import LiveBytes

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = {
        **config,
        "train_micro_batch_size_per_gpu": micro_size,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
    }
    meter = LiveBytes()
    with meter:
        model = worker.Net()
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        del model
        for _ in range(2):
            for _ in range(micro_batches):
                loss, count = worker.loss_fn(engine, worker.sample(micro_size))
                engine.backward(loss / count)
                engine.step()
    rank = int(os.environ["RANK"])
    name = type(optimizer).__name__
    # the engine freed, then both ranks past their last collective before either tears the
    # group down (a rank that exits while the other's gloo work is in flight aborts:
    # "terminate called without an active exception", about one two-process run in four)
    del engine, optimizer
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"rank": rank, "peak": meter.peak, "optimizer": name}


if __name__ == "__main__":
    torch.set_num_threads(1)
    config, micro, count, port = sys.argv[1:5]
    line = json.dumps(main(json.loads(config), int(micro), int(count), int(port))) + "\n"
    # one write call (under PIPE_BUF, so atomic): torchrun's two ranks share the pipe, and a
    # print's text and its newline in two writes interleaved them onto one line
    os.write(sys.stdout.fileno(), line.encode())
