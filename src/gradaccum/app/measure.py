"""A fresh process that trains a recipe's windows and reports the memory they took.

`gradaccum plan` and `gradaccum train` run this to measure a planned micro-batch as
training will see it: in a new process, from the first step. A module, not a command:

    python -m gradaccum.app.measure --recipe gpt --micro 20 --micro-batches 8
    python -m gradaccum.app.measure --hf-model DIR --lora-settings JSON --sample BATCH.pt ...
    python -m gradaccum.app.measure --recipe gpt --wait   # then {"micro": ...} on stdin

With ``--wait`` (how the planner runs it: ``FreshProcessVerifier``) it builds the model
first and then reads the size to measure, and the sample's path, as one JSON line.

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
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gradaccum.app.checkpoints import sealed
from gradaccum.app.folder import CHECKPOINT
from gradaccum.app.process import exit_on_end_of_input, quiet_third_parties
from gradaccum.app.recipes import get_recipe, hf_recipe
from gradaccum.batching import split, take, to_device
from gradaccum.engine import Accumulator
from gradaccum.memory import METERS, TrainingMemory
from gradaccum.recompute import enable_checkpointing


class _Built:
    """What a measurement needs before it knows the micro-batch: torch imported, the recipe,
    its model (seeded, with LoRA as the run applies it) on the device. A waiting process
    builds this while the planner probes, so a verification pays only for its windows."""

    def __init__(
        self,
        recipe_name: str | None,
        seed: int,
        *,
        hf_model: str | None = None,
        lora: dict | None = None,
    ) -> None:
        self.recipe = hf_recipe(hf_model) if hf_model else get_recipe(recipe_name)
        self.seed = seed
        torch.manual_seed(seed)
        model = self.recipe.build_model()
        if lora is not None:
            from gradaccum.integrations.peft import apply_lora

            model = apply_lora(model, **lora)
        if torch.cuda.is_available():
            model = model.cuda()
        self.model = model

    def measure(
        self,
        micro: int,
        micro_batches: int,
        windows: int,
        precision: str,
        checkpointing: bool,
        meter: str = "auto",
        sample: str | None = None,
    ) -> int:
        recipe, model = self.recipe, self.model
        if sample is not None:
            batch = take(torch.load(sample, weights_only=True), micro * micro_batches)
        else:
            batch = recipe.sample_batch(micro * micro_batches)
        if torch.cuda.is_available():
            batch = to_device(batch, torch.device("cuda"))
        if checkpointing:
            enable_checkpointing(model)
        evaluate = recipe_evaluation(recipe, self.seed, batch, micro)
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
            torch.save(sealed(state), Path(tmp) / CHECKPOINT)  # as the run writes one
            del state
        for _ in range(windows):
            acc.step(split(batch, micro), recipe.loss_fn)
            memory.window_done()
        return memory.peak()


def recipe_evaluation(recipe: Any, seed: int, batch: Any, micro: int):
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
) -> FreshProcessVerifier:
    """A ``verify`` for ``plan()``: measure a planned size where training will run, in a new
    process from its first step, with the plan's activation checkpointing. ``hf_model``
    (and ``lora``, apply_lora's arguments) instead of ``recipe``; ``sample``: a saved batch
    to train on instead of the recipe's (settable later, as ``.sample``, before the first
    measurement). Use it in a ``with`` block: its first process starts at once and waits,
    built, for the size to measure; leaving the block ends a process that was never asked."""
    source = ["--hf-model", hf_model] if hf_model else ["--recipe", str(recipe)]
    if lora is not None:
        source += ["--lora-settings", json.dumps(lora)]
    source += ["--precision", precision, "--seed", str(seed), "--meter", meter]
    return FreshProcessVerifier(source, sample)


class FreshProcessVerifier:
    """Fresh processes that each measure one planned size. The first is started ahead and
    builds its model while the planner probes (importing torch and building the model are
    most of a small recipe's verification), then reads the size from its stdin: a process
    that has measured nothing is as fresh as one started for the size. (Starting the next
    one while one measures gained nothing on 2 cores: the two compete for them.) Its stdin is a pipe
    only this process writes: if this process dies, the child reads end-of-file and exits
    instead of running on alone."""

    def __init__(self, source: list[str], sample: str | None = None) -> None:
        self._source, self.sample = source, sample
        self._next: tuple[subprocess.Popen, Any] | None = self._start()

    def _start(self) -> tuple[subprocess.Popen, Any]:
        errors = tempfile.TemporaryFile(mode="w+")  # a model's loading bars; read on failure
        cmd = [sys.executable, "-m", "gradaccum.app.measure", *self._source, "--wait"]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
        )
        return proc, errors

    def __call__(self, micro: int, micro_batches: int, checkpointing: bool) -> int:
        # One fresh process: resident memory varies by a few percent from one process to
        # the next (glibc's heap layout), which the plan's margin keeps free.
        with_ckpt = " with activation checkpointing" if checkpointing else ""
        print(
            f"measuring {_count(micro_batches, 'micro-batch', 'micro-batches')} of {micro}"
            f"{with_ckpt} in a fresh process",
            file=sys.stderr,
        )
        proc, errors = self._next or self._start()
        self._next = None
        try:
            request = {
                "micro": micro,
                "micro_batches": micro_batches,
                "ckpt": checkpointing,
                "sample": self.sample,
            }
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died while building: its stderr says why, below
            out = proc.stdout.read()
            proc.wait()
            if proc.returncode != 0:
                errors.seek(0)
                raise RuntimeError(
                    f"measuring micro-batch {micro} failed:\n{errors.read()[-2000:]}"
                )
            return int(json.loads(out.strip().splitlines()[-1])["peak"])
        finally:
            _end(proc, errors)

    def close(self) -> None:
        """End the waiting process, if no measurement took it (it holds nothing to finish)."""
        if self._next is not None:
            proc, errors = self._next
            self._next = None
            proc.kill()
            _end(proc, errors)

    def __enter__(self) -> FreshProcessVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end(proc: subprocess.Popen, errors: Any) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except BrokenPipeError:
            pass
    proc.wait()
    errors.close()


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def main(argv: list[str] | None = None) -> int:
    quiet_third_parties()  # its output is the run's log
    ap = argparse.ArgumentParser(prog="python -m gradaccum.app.measure")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe")
    source.add_argument("--hf-model")
    ap.add_argument("--lora-settings", default=None, help="apply_lora's arguments, as JSON")
    ap.add_argument("--sample", default=None)
    ap.add_argument("--micro", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=None)
    ap.add_argument("--windows", type=int, default=2)  # RSS settles after the first
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--meter", default="auto", choices=METERS)
    ap.add_argument(
        "--wait", action="store_true", help="build, then read the size from stdin as JSON"
    )
    a = ap.parse_args(argv)
    if not a.wait and (a.micro is None or a.micro_batches is None):
        ap.error("--micro and --micro-batches are needed without --wait")
    lora = None if a.lora_settings is None else json.loads(a.lora_settings)
    built = _Built(a.recipe, a.seed, hf_model=a.hf_model, lora=lora)
    micro, micro_batches, checkpointing, sample = (
        a.micro,
        a.micro_batches,
        a.checkpointing,
        a.sample,
    )
    if a.wait:
        line = sys.stdin.readline()
        if not line:
            return 0  # never asked: the plan was made without this process
        request = json.loads(line)
        micro, micro_batches = request["micro"], request["micro_batches"]
        checkpointing, sample = request["ckpt"], request["sample"]
        exit_on_end_of_input()
    peak = built.measure(
        micro, micro_batches, a.windows, a.precision, checkpointing, a.meter, sample
    )
    print(json.dumps({"peak": peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
