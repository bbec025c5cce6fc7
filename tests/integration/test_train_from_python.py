"""The command and Python train the same run: ``gradaccum train --recipe minilm ...`` and
``gradaccum.app.train(TrainConfig.of(recipe="minilm", ...))`` resolve the recipe's defaults in
one place (TrainConfig), so their runs are equal bit for bit. Before 0.6 only the command
applied them, and Python trained minilm at TrainConfig's own learning rate."""

import json

import pytest
import torch
from helpers import cli, run_lines

from gradaccum.app import TrainConfig, train
from gradaccum.app.recipes import minilm

TRIMMED = {
    "steps": 2,
    "effective_batch": 8,
    "micro_batch": 4,
    "eval_every": 2,
    "checkpoint_every": 2,
    "tensorboard": False,
}


FLAGS = ["--steps", "2", "--effective-batch", "8", "--micro-batch", "4", "--eval-every", "2"]
FLAGS += ["--checkpoint-every", "2", "--no-tensorboard"]


@pytest.mark.slow
def test_the_command_and_python_train_minilm_bit_for_bit(tmp_path):
    cli("train", "--recipe", "minilm", *FLAGS, "--out", tmp_path / "cli", threads=1)
    torch.set_num_threads(1)
    train(TrainConfig.of(recipe="minilm", **TRIMMED, out=str(tmp_path / "py")), log=lambda *a: None)

    configs = [json.loads((tmp_path / r / "config.json").read_text()) for r in ("cli", "py")]
    assert {k: v for k, v in configs[0].items() if k != "out"} == {
        k: v for k, v in configs[1].items() if k != "out"
    }
    # What the trimmed options leave to the recipe is the recipe's, on both paths.
    assert configs[1]["lr"] == minilm.DEFAULTS["lr"] != TrainConfig.of(recipe="gpt").schedule.lr
    assert configs[1]["warmup_steps"] == minilm.DEFAULTS["warmup_steps"]

    losses = [[x["loss"] for x in run_lines(tmp_path / r)] for r in ("cli", "py")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    a, b = (torch.load(tmp_path / r / "checkpoint.pt", weights_only=True) for r in ("cli", "py"))
    model_a, model_b = a["accumulator"]["model"], b["accumulator"]["model"]
    assert model_a.keys() == model_b.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
