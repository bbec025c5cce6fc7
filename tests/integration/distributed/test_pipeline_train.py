"""`torchrun --nproc-per-node 2 -m gradaccum train --pipeline-stages 2`: the built-in GPT cut
into 2 stages in 2 real processes (gloo, 127.0.0.1). Its losses equal the same run in one
process (the independent reference: no pipeline, no stages, autograd over the whole model),
and a run stopped by SIGTERM and resumed ends bitwise equal to one that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import helpers
import pytest
import torch
from helpers import max_rel_err
from launch import torchrun

# 20 steps of 16 sequences; no --micro-batch: the pipeline planner chooses the micro-batches.
ARGS = ["train", "--steps", "20", "--effective-batch", "16", "--eval-every", "10"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    return helpers.run(cmd, cwd, timeout=90)


metrics = helpers.run_lines


def whole_model(folder) -> dict[str, torch.Tensor]:
    """The stages' parts of the last checkpoint, together: the GPT's state_dict."""
    first = torch.load(folder / "checkpoint.pt", weights_only=True)
    files = list((folder / "stages").glob(f"stage-1-step-{first['step']:08d}.pt"))
    assert len(files) == 1, sorted(p.name for p in (folder / "stages").iterdir())
    last = torch.load(files[0], weights_only=True)
    return {**first["accumulator"]["model"], **last["accumulator"]["model"]}


@pytest.mark.slow
def test_two_stages_train_as_one_process_and_resume_bitwise(tmp_path):
    pipeline = [*torchrun(), "-m", "gradaccum", *ARGS, "--pipeline-stages", "2"]
    proc = run([*pipeline, "--out", "two"], tmp_path)
    # The one-process reference at the micro-batch the pipeline planned (any would do).
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["source"] == "planned" and plan["pipeline"]["micro_batches"] == 4, plan
    assert "pipeline plan: 4 micro-batches of 4 through 2 stages (1f1b)" in proc.stdout
    micro = str(plan["micro_size"])
    single = [sys.executable, "-m", "gradaccum", *ARGS, "--micro-batch", micro]
    run([*single, "--out", "one"], tmp_path)

    two, one = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [x["step"] for x in two] == list(range(1, 21))
    for a, b in zip(two, one, strict=True):
        assert a["count"] == b["count"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a["step"], a["loss"], b["loss"])
        if "eval_loss" in b:  # evaluated through both stages' chained forward
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * b["eval_loss"]
    assert sum("eval_loss" in a for a in two) == 2
    # The first window's norm, before rounding differences pass through AdamW: over both
    # stages, the tied embedding and head counted once with their two gradients summed.
    assert abs(two[0]["grad_norm"] - one[0]["grad_norm"]) <= 1e-6 * one[0]["grad_norm"]
    parts = whole_model(tmp_path / "two")
    reference = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    assert parts.keys() == reference["accumulator"]["model"].keys()
    assert max_rel_err(parts, reference["accumulator"]["model"]) <= 1e-5
    assert torch.equal(parts["tok.weight"], parts["head.weight"])  # the tied copies agree

    # SIGTERM mid-run (to torchrun, which passes it on), then --resume: bitwise the same.
    stopped = subprocess.Popen(
        [*pipeline, "--out", "stopped", "--checkpoint-every", "500"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 60
    # At the first step's line: the run has 19 windows left to take the signal in.
    while time.time() < deadline and not (lines.exists() and lines.read_text().count("\n") >= 1):
        time.sleep(0.02)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode != 0 and err.count("stopped by SIGTERM at step") == 1, err[-3000:]
    at = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)["step"]
    assert 1 <= at < 20, at
    # The stage files of the stop's step alone (and step 0's, which the guard keeps).
    kept = sorted(p.name for p in (tmp_path / "stopped" / "stages").iterdir())
    assert kept == ["stage-1-step-00000000.pt", f"stage-1-step-{at:08d}.pt"], kept
    resumed = run([*torchrun(), "-m", "gradaccum", "train", "--resume", "stopped"], tmp_path)
    assert f"resuming stopped at step {at} of 20" in resumed.stdout

    again = metrics(tmp_path / "stopped")
    assert [x["step"] for x in again] == list(range(1, 21))
    assert [x["loss"] for x in again] == [x["loss"] for x in two]
    final, want = whole_model(tmp_path / "stopped"), whole_model(tmp_path / "two")
    assert all(torch.equal(final[k], want[k]) for k in want)

    # One bit of stage 1's part of step 20 flipped: every stage goes back to the kept step 0
    # (the newest checkpoint whose every part is intact), said once, and trains it all again.
    import shutil

    from support.faults import flip_tensor_bit

    shutil.copytree(tmp_path / "two", tmp_path / "damaged")
    flip_tensor_bit(tmp_path / "damaged" / "stages" / "stage-1-step-00000020.pt", record=1)
    again = run([*torchrun(), "-m", "gradaccum", "train", "--resume", "damaged"], tmp_path)
    assert "stage-1-step-00000020.pt is damaged: its contents do not match" in again.stdout
    assert "step-00000000.pt instead, the newest intact checkpoint (step 0)" in again.stdout
    assert [x["loss"] for x in metrics(tmp_path / "damaged")] == [x["loss"] for x in two]
    final = whole_model(tmp_path / "damaged")
    assert all(torch.equal(final[k], want[k]) for k in want)


@pytest.mark.slow
def test_the_guard_rolls_every_stage_back_and_evaluates_through_both(tmp_path):
    """A learning rate of 10,000 without clipping: every window is skipped, the guard rolls
    both stages back to step 0 (each stage's own file of that step) three times, then stops.
    The held-out loss it reports is the untrained model's, evaluated through both stages:
    equal to one process's evaluation of the freshly built GPT."""
    from gradaccum.app.recipes import get_recipe

    args = ["--steps", "40", "--effective-batch", "16", "--micro-batch", "4", "--lr", "1e4"]
    args += ["--max-grad-norm", "0", "--no-tensorboard", "--out", "div"]
    proc = subprocess.run(
        [*torchrun(), "-m", "gradaccum", "train", "--pipeline-stages", "2", *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode != 0 and "the incident guard stopped the run" in proc.stderr
    incidents = [
        json.loads(x) for x in (tmp_path / "div" / "incidents.jsonl").read_text().splitlines()
    ]
    assert [i["retry"] for i in incidents] == [1, 2, 3, 3]
    assert {i["rolled_back_to"] for i in incidents} == {0}
    summary = json.loads((tmp_path / "div" / "summary.json").read_text())
    assert summary["stopped_by"] == "guard"
    # (its windows had 4 micro-batches each: "needs windows of 2+ micro-batches" was wrong)
    assert summary["noise_advice"] == (
        "gradient noise scale: not measured (a pipeline's stages never hold a micro-batch's "
        "whole gradient)"
    )

    recipe = get_recipe("gpt")
    torch.manual_seed(0)
    fresh = recipe.build_model()
    want = recipe.make_data(0).evaluate(fresh, 4)["loss"]
    assert abs(summary["held_out_loss"] - want) <= 1e-5 * want, (summary["held_out_loss"], want)


@pytest.mark.slow
def test_fp16_through_two_stages_skips_and_steps_as_one_process(tmp_path):
    """fp16 autocast on both stages, one loss scale: the first window overflows at the
    starting scale (65536) in one process and in the pipeline alike, both skip it and halve
    the scale, and the losses follow one process's fp16 run (the same micro-batches)."""
    args = [*ARGS[:2], "4", *ARGS[3:], "--precision", "fp16", "--no-tensorboard"]
    run([*torchrun(), "-m", "gradaccum", *args, "--pipeline-stages", "2", "--out", "two"], tmp_path)
    run([sys.executable, "-m", "gradaccum", *args, "--micro-batch", "4", "--out", "one"], tmp_path)
    two, one = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [x["skipped"] for x in two] == [x["skipped"] for x in one]
    assert one[0]["skipped"] == "fp16 overflow" and one[1]["skipped"] is None
    # The first two windows run the initial model (the first was skipped): fp16's forward on
    # the same parameters, to the last bit where fp32's differs by about 5e-6.
    for a, b in zip(two[:2], one[:2], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * b["loss"], (a["loss"], b["loss"])
    for a, b in zip(two, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a["step"], a["loss"], b["loss"])
