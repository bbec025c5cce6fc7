"""A fresh process that trains a recipe's windows and reports the memory they took.

`gradaccum plan` and `gradaccum train` run this to measure a planned micro-batch as
training will see it: in a new process, from the first step. A module, not a command:

    python -m gradaccum.app.measure --recipe gpt --micro 20 --micro-batches 8
    python -m gradaccum.app.measure --hf-model DIR --lora 8 --sample BATCH.pt --micro 4 ...

A Hugging Face model (``--hf-model``, with ``--lora`` as the run applies it) or a recipe
trained on your own data trains on ``--sample``: a batch of the largest shape the data
makes (``torch.save``-d by the planner, read with ``weights_only``), its rows repeated.

Prints one JSON line: {"peak": bytes}. On CPU: parameters and buffers (counted tensor by
tensor) plus how far the resident set's high-water mark rose above the baseline taken once
the model and optimizer exist; on CUDA: the allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from gradaccum.app.folder import sealed
from gradaccum.app.recipes import get_recipe, hf_recipe
from gradaccum.batching import split, take, to_device
from gradaccum.engine import Accumulator
from gradaccum.memory import METERS, TrainingMemory
from gradaccum.recompute import enable_checkpointing


def measure(
    recipe_name: str | None,
    micro: int,
    micro_batches: int,
    windows: int,
    precision: str,
    checkpointing: bool,
    seed: int,
    meter: str = "auto",
    *,
    hf_model: str | None = None,
    lora: dict | None = None,
    sample: str | None = None,
) -> int:
    recipe = hf_recipe(hf_model) if hf_model else get_recipe(recipe_name)
    if sample is not None:
        batch = take(torch.load(sample, weights_only=True), micro * micro_batches)
    else:
        batch = recipe.sample_batch(micro * micro_batches)
    torch.manual_seed(seed)
    model = recipe.build_model()
    if lora is not None:
        from gradaccum.integrations.peft import apply_lora

        model = apply_lora(model, **lora)
    if torch.cuda.is_available():
        model = model.cuda()
        batch = to_device(batch, torch.device("cuda"))
    if checkpointing:
        enable_checkpointing(model)
    evaluate = _evaluation(recipe, seed, batch, micro)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    acc = Accumulator(model, optimizer, precision=precision)
    memory = TrainingMemory(model, next(model.parameters()).device, meter)
    for _ in range(windows):
        acc.step(split(batch, micro), recipe.loss_fn)
        memory.window_done()  # as the run's loop does between windows
    # The run in miniature: an evaluation and a checkpoint between windows, then windows
    # again. Training after an evaluation peaks higher than before it (freed blocks of
    # other sizes, kernels' caches for other shapes), which windows alone never show.
    evaluate(model)
    with tempfile.TemporaryDirectory(prefix="gradaccum-measure-") as tmp:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(sealed(state), Path(tmp) / "checkpoint.pt")  # as the run writes one
        del state
    for _ in range(windows):
        acc.step(split(batch, micro), recipe.loss_fn)
        memory.window_done()
    return memory.peak()


def _evaluation(recipe: Any, seed: int, batch: Any, micro: int):
    """The run's held-out evaluation, two micro-batches of it, through the arithmetic the
    run's evaluation runs: a language model's ``held_out_loss`` or the recipe's
    ``evaluate`` on the sample, else the recipe's data's own ``evaluate``. An evaluation by
    the training loss instead leaves the process holding other blocks than the run's does,
    and the windows after it peak higher than the run's (bench/results/planner.md)."""
    held = take(batch, 2 * micro)
    if recipe.logits is not None:
        from gradaccum.app.recipes import held_out_loss

        return lambda model: held_out_loss(
            model, recipe.logits, held["input_ids"], held["labels"], micro
        )
    if recipe.evaluate is not None:
        return lambda model: recipe.evaluate(model, held, micro)
    data = recipe.make_data(seed)
    return lambda model: data.evaluate(model, micro, limit=2 * micro)


def fresh_process_verifier(
    recipe: str | None,
    precision: str = "fp32",
    seed: int = 0,
    meter: str = "auto",
    *,
    hf_model: str | None = None,
    lora: dict | None = None,
    sample: str | None = None,
):
    """A ``verify`` for ``plan()``: measure a planned size where training will run, in a new
    process from its first step, with the plan's activation checkpointing. ``hf_model``
    (and ``lora``, apply_lora's arguments) instead of ``recipe``; ``sample``: a saved batch
    to train on instead of the recipe's. Each child gets the read end of a pipe whose write
    end only this process holds: if this process dies (SIGTERM, SIGKILL, a crash), the child
    reads end-of-file and exits instead of running on alone."""
    source = ["--hf-model", hf_model] if hf_model else ["--recipe", str(recipe)]
    if lora is not None:
        source += ["--lora-settings", json.dumps(lora)]
    if sample is not None:
        source += ["--sample", sample]

    def verify(micro: int, micro_batches: int, checkpointing: bool) -> int:
        # One fresh process: resident memory varies by a few percent from one process to
        # the next (glibc's heap layout), which the plan's margin keeps free.
        with_ckpt = " with activation checkpointing" if checkpointing else ""
        print(
            f"measuring {_count(micro_batches, 'micro-batch', 'micro-batches')} of {micro}"
            f"{with_ckpt} in a fresh process",
            file=sys.stderr,
        )
        return _measure_once(micro, micro_batches, checkpointing)

    def _measure_once(micro: int, micro_batches: int, checkpointing: bool) -> int:
        read, write = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "gradaccum.app.measure",
            *source,
            "--micro",
            str(micro),
            "--micro-batches",
            str(micro_batches),
            "--precision",
            precision,
            "--seed",
            str(seed),
            "--parent-pipe",
            str(read),
            "--meter",
            meter,
        ]
        if checkpointing:
            cmd.append("--checkpointing")
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, check=False, pass_fds=(read,)
            )
        finally:
            os.close(read)
            os.close(write)
        if proc.returncode != 0:
            raise RuntimeError(f"measuring micro-batch {micro} failed:\n{proc.stderr[-2000:]}")
        return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak"])

    return verify


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _exit_with_parent(fd: int) -> None:
    """Exit as soon as the pipe from the parent closes (the parent is gone)."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradaccum.app.measure")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe")
    source.add_argument("--hf-model")
    ap.add_argument("--lora-settings", default=None, help="apply_lora's arguments, as JSON")
    ap.add_argument("--sample", default=None)
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--micro-batches", type=int, required=True)
    ap.add_argument("--windows", type=int, default=2)  # RSS settles after the first
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parent-pipe", type=int, default=None)
    ap.add_argument("--meter", default="auto", choices=METERS)
    a = ap.parse_args(argv)
    if a.parent_pipe is not None:
        _exit_with_parent(a.parent_pipe)
    peak = measure(
        a.recipe,
        a.micro,
        a.micro_batches,
        a.windows,
        a.precision,
        a.checkpointing,
        a.seed,
        a.meter,
        hf_model=a.hf_model,
        lora=None if a.lora_settings is None else json.loads(a.lora_settings),
        sample=a.sample,
    )
    print(json.dumps({"peak": peak}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
