"""A fresh process's measurement of a planned micro-batch, and the verifier that asks for it.

`gradaccum plan` and `gradaccum train` measure a planned micro-batch as training will see
it: in a new process, from the first step (``python -m gradaccum.app.worker`` with a
``fresh.Measure`` request, then the ``fresh.Size`` to measure: app/fresh.py). The process
builds the model first (``Built``) and then reads the size, so a verification pays only for
its windows.

A Hugging Face model (with its LoRA as the run applies it) or a recipe trained on your own
data trains on the request's ``sample``: a batch of the largest shape the data makes
(``torch.save``-d by the planner, read with ``weights_only``), its rows repeated.

The answer is the peak in bytes. On CPU: parameters and buffers (counted tensor by tensor)
plus how far the resident set's high-water mark rose above the baseline taken once the
model and optimizer exist; on CUDA: the allocator's peak.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gradaccum.app.checkpoints import sealed
from gradaccum.app.folder import CHECKPOINT
from gradaccum.app.fresh import Child, Measure, Size
from gradaccum.app.recipes import get_recipe, hf_recipe
from gradaccum.batching import split, take, to_device
from gradaccum.engine import Accumulator
from gradaccum.memory import TrainingMemory
from gradaccum.recompute import enable_checkpointing


class Built:
    """What a measurement needs before it knows the micro-batch: torch imported, the recipe,
    its model (seeded, with LoRA as the run applies it) on the device. A waiting process
    builds this while the planner probes, so a verification pays only for its windows."""

    def __init__(self, request: Measure) -> None:
        self.request = request
        hf_model, lora = request.hf_model, request.lora
        self.recipe = hf_recipe(hf_model) if hf_model else get_recipe(request.recipe)
        self.seed = request.seed
        torch.manual_seed(request.seed)
        model = self.recipe.build_model()
        if lora is not None:
            from gradaccum.integrations.peft import apply_lora

            model = apply_lora(model, **lora)
        if torch.cuda.is_available():
            model = model.cuda()
        self.model = model

    def measure(self, size: Size) -> int:
        """Peak bytes of the request's windows at ``size``, with an evaluation and a
        checkpoint between them, as the run has, cycle after cycle until it settles."""
        micro_size, micro_batches, sample = size.micro_size, size.micro_batches, size.sample
        windows, precision, meter = self.request.windows, self.request.precision, self.request.meter
        recipe, model = self.recipe, self.model
        if sample is not None:
            batch = take(torch.load(sample, weights_only=True), micro_size * micro_batches)
        else:
            batch = recipe.sample_batch(micro_size * micro_batches)
        if torch.cuda.is_available():
            batch = to_device(batch, torch.device("cuda"))
        if size.checkpointing:
            enable_checkpointing(model)
        evaluate = recipe_evaluation(recipe, self.seed, batch, micro_size)
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        acc = Accumulator(model, optimizer, precision=precision)
        memory = TrainingMemory(model, next(model.parameters()).device, meter)
        # The run in miniature: windows, then an evaluation and a checkpoint, over and over,
        # until the peak settles. With glibc's moving mmap threshold the resident set of
        # the same windows climbs for several of them (freed blocks of other sizes, an
        # evaluation's, kept in the heap): a run of several evaluations peaked above a
        # miniature of one cycle by more than the plan may be under
        # (bench/results/planner.md).
        peaks: list[int] = []
        while len(peaks) < _MOST_CYCLES:
            for _ in range(windows):
                acc.step(split(batch, micro_size), recipe.loss_fn)
                memory.window_done()  # as the run's loop does between windows
            peaks.append(memory.peak())
            if settled(peaks):
                break
            evaluate(model)
            with tempfile.TemporaryDirectory(prefix="gradaccum-measure-") as tmp:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(sealed(state), Path(tmp) / CHECKPOINT)  # as the run writes one
                del state
        return peaks[-1]


# Cycles of the run in miniature (windows, an evaluation, a checkpoint): at least
# _FEWEST_CYCLES, then until _SETTLED_CYCLES in a row raised the peak by under _SETTLED.
_FEWEST_CYCLES, _MOST_CYCLES, _SETTLED_CYCLES, _SETTLED = 3, 8, 2, 0.01


def settled(peaks: list[int]) -> bool:
    """Whether the miniature's peaks, one per cycle, have stopped climbing: at least the
    fewest cycles, and the last ones each under 1% above the one before."""
    if len(peaks) < max(_FEWEST_CYCLES, _SETTLED_CYCLES + 1):
        return False
    last = peaks[-_SETTLED_CYCLES - 1 :]
    return all(b <= a * (1 + _SETTLED) for a, b in zip(last, last[1:], strict=False))


def recipe_evaluation(recipe: Any, seed: int, batch: Any, micro_size: int):
    """The run's held-out evaluation, two micro-batches of it, through the arithmetic the
    run's evaluation runs: a language model's ``held_out_loss`` or the recipe's
    ``evaluate`` on the sample, else the recipe's data's own ``evaluate``. An evaluation by
    the training loss instead leaves the process holding other blocks than the run's does,
    and the windows after it peak higher than the run's (bench/results/planner.md)."""
    held = take(batch, 2 * micro_size)
    if recipe.logits is not None:
        from gradaccum.app.recipes import held_out_loss

        return lambda model: held_out_loss(
            model, recipe.logits, held["input_ids"], held["labels"], micro_size
        )
    if recipe.evaluate is not None:
        return lambda model: recipe.evaluate(model, held, micro_size)
    data = recipe.make_data(seed)
    return lambda model: data.evaluate(model, micro_size, limit=2 * micro_size)


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
    request = Measure(
        recipe=None if hf_model else str(recipe), hf_model=hf_model, lora=lora,
        precision=precision, seed=seed, meter=meter,
    )  # fmt: skip
    return FreshProcessVerifier(request, sample)


class FreshProcessVerifier:
    """Fresh processes that each measure one planned size. The first is started ahead and
    builds its model while the planner probes (importing torch and building the model are
    most of a small recipe's verification), then reads the size from its stdin: a process
    that has measured nothing is as fresh as one started for the size. (Starting the next
    one while one measures gained nothing on 2 cores: the two compete for them.) Its stdin
    is a pipe only this process writes: if this process dies, the child reads end-of-file
    and exits instead of running on alone."""

    def __init__(self, request: Measure, sample: str | None = None) -> None:
        self.request, self.sample = request, sample
        self._next: Child | None = self._start()

    def _start(self) -> Child:
        return Child(self.request, stderr="keep")  # a model's loading bars: read on failure

    def __call__(self, micro_size: int, micro_batches: int, checkpointing: bool) -> int:
        # One fresh process: resident memory varies by a few percent from one process to
        # the next (glibc's heap layout), which the plan's margin keeps free.
        with_ckpt = " with activation checkpointing" if checkpointing else ""
        print(
            f"measuring micro-batch {micro_size}, as the plan would train it, in a "
            f"fresh process ({_count(micro_batches, 'micro-batch', 'micro-batches')} a window"
            f"{with_ckpt})",
            file=sys.stderr,
        )
        child = self._next or self._start()
        self._next = None
        with child:
            child.send(Size(micro_size=micro_size, micro_batches=micro_batches,
                            checkpointing=checkpointing, sample=self.sample))  # fmt: skip
            return int(child.result(what=f"measuring micro-batch {micro_size}"))

    def close(self) -> None:
        """End the waiting process, if no measurement took it (it holds nothing to finish)."""
        if self._next is not None:
            self._next.close()
            self._next = None

    def __enter__(self) -> FreshProcessVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
