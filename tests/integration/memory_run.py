"""Run in a fresh process: train a recipe's windows and report the peak memory it added.

    python tests/memory_run.py --recipe gpt --micro 26 --effective 256 --windows 2
    python tests/memory_run.py --recipe gpt --micro 4 --compare-n 8

Prints one JSON line. On CPU, peak = the parameters' and buffers' bytes (counted tensor by
tensor) + how far the resident set's high-water mark rose above the pre-training baseline,
taken once the data, model and optimizer exist and before the first step. (Before the
model exists is no baseline: building a torch optimizer imports torch._dynamo, ~70 MiB of
RSS that is the library's, not training's.)
"""

import argparse
import json

import torch

import gradaccum as ga
from gradaccum.app.recipes import get_recipe
from gradaccum.memory import MemoryMeter, tensor_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="gpt")
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--effective", type=int)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--compare-n", type=int)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--meter", default="auto", choices=["auto", "rss", "tensors"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    recipe = get_recipe(args.recipe)
    n_samples = args.effective or args.micro * (args.compare_n or 1)
    batch = recipe.sample_batch(n_samples)
    torch.manual_seed(0)
    model = recipe.build_model()
    if args.checkpointing:
        ga.enable_checkpointing(model)
    acc = ga.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    resident = tensor_bytes(list(model.parameters()) + list(model.buffers()))
    meter = MemoryMeter("cpu", args.meter)
    meter.start()  # the pre-training baseline
    if args.compare_n:
        one = ga.split(batch, args.micro)[:1]
        acc.step(one, recipe.loss_fn)  # warm-up: optimizer state and first-step allocations
        peaks = {}
        for n in (1, args.compare_n):
            meter.start()
            acc.step(ga.split(batch, args.micro)[:n], recipe.loss_fn)
            peaks[n] = meter.peak()
        print(json.dumps({"peak_n1": peaks[1], "peak_n": peaks[args.compare_n]}))
        return
    for _ in range(args.windows):
        result = acc.step(ga.split(batch, args.micro), recipe.loss_fn)
        assert result.stepped and result.count > 0
    print(
        json.dumps(
            {
                "peak": resident + meter.peak(),
                "windows": args.windows,
                "micro_batches": len(ga.split(batch, args.micro)),
            }
        )
    )


if __name__ == "__main__":
    main()
