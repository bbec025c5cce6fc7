"""`gradaccum train` end to end: real subprocesses, real run folders, real signals."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import cli, run_lines, sigterm_then_resume_matches
from test_faults import in_process

from gradaccum.app import TrainConfig, train
from gradaccum.app.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "2"}


metrics = run_lines


def check_run_folder(run: Path, steps: int) -> list[dict]:
    for name in (
        "config.json",
        "plan.json",
        "metrics.jsonl",
        "checkpoint.pt",
        "summary.json",
        "loss.png",
        "memory.png",
        "batch.png",
    ):
        assert (run / name).is_file(), f"{name} missing from {run}"
    lines = metrics(run)
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    for key in ("loss", "lr", "grad_norm", "count", "seconds", "peak_memory", "skipped"):
        assert key in lines[0]
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == steps and ckpt["accumulator"]["accumulator"]["optimizer_steps"] == steps
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["held_out_loss"] > 0
    return lines


def falls(lines: list[dict], by: float) -> bool:
    first = sum(x["loss"] for x in lines[:3]) / 3
    last = sum(x["loss"] for x in lines[-3:]) / 3
    return last < first - by


def test_gpt_recipe_trains_and_fills_its_run_folder(tmp_path):
    run = tmp_path / "gpt"
    out = cli(
        "train",
        "--steps",
        16,
        "--effective-batch",
        8,
        "--micro-batch",
        4,
        "--eval-every",
        8,
        "--out",
        run,
    ).stdout
    lines = check_run_folder(run, 16)
    assert falls(lines, by=0.8), [x["loss"] for x in lines]
    assert all(x["count"] == 8 * 127 for x in lines)  # 8 sequences, 127 shifted labels each
    assert "eval_loss" in lines[7] and "eval_loss" in lines[15]
    assert "summary" in out and "held out loss" in out
    assert lines[-1]["noise_scale"] > 0  # B_simple, in tokens
    assert "gradient noise scale B_simple ~" in out
    assert json.loads((run / "summary.json").read_text())["noise_scale"] > 0


def test_digits_recipe_reports_held_out_accuracy(tmp_path):
    run = tmp_path / "digits"
    cli(
        "train",
        "--recipe",
        "digits",
        "--steps",
        40,
        "--effective-batch",
        64,
        "--micro-batch",
        16,
        "--eval-every",
        20,
        "--out",
        run,
    )
    lines = check_run_folder(run, 40)
    assert falls(lines, by=0.5), [x["loss"] for x in lines]
    summary = json.loads((run / "summary.json").read_text())
    print(f"digits: held-out accuracy {summary['held_out_accuracy']:.3f}")
    assert summary["held_out_accuracy"] > 0.8
    # 1437 training images in windows of 64: every 23rd window is the ragged 29-image tail
    assert lines[22]["count"] == 1437 - 22 * 64


def tiny_hf_model(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.slow
def test_local_hugging_face_model_trains(tmp_path):
    model_dir = tiny_hf_model(tmp_path / "tiny-gpt2")
    run = tmp_path / "hf"
    cli(
        "train",
        "--hf-model",
        model_dir,
        "--steps",
        20,
        "--effective-batch",
        8,
        "--micro-batch",
        4,
        "--lr",
        1e-2,
        "--eval-every",
        10,
        "--out",
        run,
    )
    lines = check_run_folder(run, 20)
    assert all(x["count"] == 8 * 63 for x in lines)  # tokens counted on shifted labels
    assert falls(lines, by=0.5), [x["loss"] for x in lines]
    # a config file alone builds the same architecture, randomly initialized
    run2 = tmp_path / "hf-config"
    cli(
        "train",
        "--hf-model",
        model_dir / "config.json",
        "--steps",
        2,
        "--effective-batch",
        4,
        "--micro-batch",
        2,
        "--out",
        run2,
    )
    check_run_folder(run2, 2)


@pytest.mark.slow
def test_sigterm_mid_ramp_then_resume_equals_an_uninterrupted_run(tmp_path):
    """A linear ramp of the effective batch from 8 to 24 over the first 120 samples, in
    micro-batches of 4 (the last one of each window of 8 ragged at 3 would not be whole:
    batches are rounded to 4s), stopped while it ramps."""
    args = ["--samples", 240, "--effective-batch", 8, "--micro-batch", 4]
    args += ["--batch-schedule", "linear:120=24", "--checkpoint-every", 100, "--eval-every", 100]
    sigterm_then_resume_matches(tmp_path, args, stop_after=4, steps=None)
    lines = metrics(tmp_path / "straight")
    batches = [x["effective_batch"] for x in lines]
    assert batches[0] == 8 and max(batches) == 24 and batches == sorted(batches[:-1]) + batches[-1:]
    assert all(b % 4 == 0 for b in batches[:-1]) and lines[-1]["samples"] == 240
    stopped = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)
    assert stopped["schedule"]["samples"] == 240


@pytest.mark.slow
def test_auto_batch_schedule_from_the_cli(tmp_path):
    """auto on digits: a micro-batch as large as the starting batch is halved (the noise
    scale needs 2+ micro-batches), batches only grow, in whole micro-batches, within the
    ceiling, and --samples is met exactly."""
    run = tmp_path / "auto"
    out = cli(
        "train",
        "--recipe",
        "digits",
        "--effective-batch",
        16,
        "--micro-batch",
        16,
        "--batch-schedule",
        "auto",
        "--max-effective-batch",
        64,
        "--samples",
        1600,
        "--eval-every",
        1000,
        "--out",
        run,
    ).stdout
    assert "needs 2+ micro-batches per window: micro-batch 8" in out
    assert "schedule: auto: from 16" in out
    lines = metrics(run)
    # (a window that ends an epoch of 1,437 images, or the run, takes what is left)
    whole = [x["effective_batch"] for x in lines[:-1] if x["samples"] % 1437]
    assert whole == sorted(whole) and max(whole) <= 64 and all(b % 8 == 0 for b in whole)
    assert lines[-1]["samples"] == 1600
    summary = json.loads((run / "summary.json").read_text())
    print("auto on digits:", summary["batch_changes"], summary["noise_advice"])
    assert summary["samples"] == 1600 and (run / "batch.png").is_file()
    assert summary["noise_advice"].startswith("gradient noise scale")
    assert summary["noise_tradeoff"] is None or summary["noise_tradeoff"].startswith(
        "against a batch of one sample, this batch"
    )


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".toml", 'effective_batch = 0\nlr = -1.0\nprecision = "fp8"\n'),
        (".yaml", "effective-batch: 0\nlr: -1.0\nprecision: fp8\n"),
    ],
)
def test_three_config_mistakes_are_reported_together(tmp_path, suffix, text):
    config = tmp_path / f"bad{suffix}"
    config.write_text(text)
    proc = cli("train", "--config", config, "--out", tmp_path / "run", check=False)
    assert proc.returncode == 2
    for part in (
        "--effective-batch must be an integer >= 1, got 0",
        "--lr must be a positive finite number, got -1.0",
        "--precision must be one of fp32, bf16, fp16, got 'fp8'",
    ):
        assert part in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_unknown_config_keys_and_wrong_types_are_refused(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("learning_rate = 0.1\nsteps = 5\n")
    proc = in_process("train", "--config", config)
    assert proc.returncode == 2, proc.stderr
    assert "unknown option learning_rate (did you mean lr?); every option is listed" in proc.stderr
    config.write_text('steps = "five"\n')
    proc = in_process("train", "--config", config)
    assert proc.returncode == 2 and "steps must be int, got 'five'" in proc.stderr


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("recipe: digits\nsteps: 50\neffective_batch: 16\nmicro_batch: 8\n")
    run = tmp_path / "run"
    done = in_process("train", "--config", config, "--steps", 2, "--out", run, "--no-tensorboard")
    assert done.returncode == 0, done.stderr
    saved = json.loads((run / "config.json").read_text())
    assert saved["steps"] == 2 and saved["recipe"] == "digits" and saved["effective_batch"] == 16


@pytest.mark.slow
def test_a_checkpoint_from_another_model_is_refused(tmp_path):
    run = tmp_path / "digits"
    cli(
        "train",
        "--recipe",
        "digits",
        "--steps",
        2,
        "--effective-batch",
        8,
        "--micro-batch",
        4,
        "--out",
        run,
    )
    # A resume that would change the model is refused from the saved configuration...
    proc = cli("train", "--resume", run, "--recipe", "gpt", check=False)
    assert proc.returncode == 2
    assert "would change recipe 'digits' -> 'gpt'" in proc.stderr
    # ...and a checkpoint that another model wrote, from the checkpoint's signature.
    other = tmp_path / "gpt"
    cli("train", "--steps", 2, "--effective-batch", 8, "--micro-batch", 4, "--out", other)
    (other / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes())
    proc = cli("train", "--resume", other, check=False)
    assert proc.returncode == 2
    assert "was written for another model: recipe digits" in proc.stderr
    assert "this run builds recipe gpt" in proc.stderr


def test_help_and_docs_cli_md_list_every_command_and_option():
    reference = (ROOT / "docs" / "cli.md").read_text()
    top = in_process("--help").stdout  # the command's own main(), in this process
    assert "train" in top and "plan" in top
    text = " ".join(in_process("train", "--help").stdout.split())
    for f in (f for section in SECTIONS.values() for f in dataclasses.fields(section)):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert f"`{flag}`" in reference, f"docs/cli.md does not document {flag}"
        first_words = " ".join(f.metadata["help"].split()[:4])
        assert first_words in text, (flag, first_words)
    plan_help = in_process("plan", "--help").stdout.split()
    # every word that is a flag (a help text that names one, as "--budget)", is prose)
    words = {w.strip("[]|,") for w in plan_help}
    plan_flags = {w for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*", w)}
    plan_flags.discard("--help")
    assert {"--budget", "--effective-batch"} <= plan_flags, plan_flags
    for flag in sorted(plan_flags):
        assert f"`{flag}`" in reference, f"docs/cli.md does not document gradaccum plan {flag}"


@pytest.mark.slow
def test_epochs_precision_and_a_planned_micro_batch(tmp_path):
    run = tmp_path / "digits"
    out = cli(
        "train",
        "--recipe",
        "digits",
        "--epochs",
        1,
        "--effective-batch",
        256,
        "--budget",
        "300MB",
        "--precision",
        "bf16",
        "--out",
        run,
    ).stdout
    lines = check_run_folder(run, 6)  # 1437 training images in windows of 256: 6 steps
    assert [x["count"] for x in lines] == [256] * 5 + [1437 - 5 * 256]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["source"] == "planned" and sum(plan["micro_sizes"]) == 256
    assert "measured at micro-batch" in out and "the fit's prediction" in out
    assert json.loads((run / "config.json").read_text())["precision"] == "bf16"


@pytest.mark.slow
def test_the_same_command_again_trains_on_its_cached_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "plans"))
    args = ["train", "--recipe", "digits", "--steps", 2, "--budget", "300MB", "--no-tensorboard"]
    said = {}
    for name, extra in (("first", []), ("again", []), ("replan", ["--replan"])):
        proc = cli(*args, *extra, "--out", tmp_path / name, threads=1)
        said[name] = proc.stdout + proc.stderr
    assert "planning the micro-batch" in said["first"] and "measuring" in said["first"]
    assert "the plan is the cached one" in said["again"], said["again"]
    assert "planning the micro-batch" not in said["again"] and "measuring" not in said["again"]
    assert "measuring" in said["replan"] and "cached" not in said["replan"]
    plans = [json.loads((tmp_path / n / "plan.json").read_text()) for n in said]
    assert plans[0]["micro_size"] == plans[1]["micro_size"] and plans[1] == plans[0]
    other = cli(*args[:-2], "400MB", "--no-tensorboard", "--out", tmp_path / "other", threads=1)
    assert "measuring" in other.stdout + other.stderr  # another budget: another plan
    resumed = cli("train", "--resume", tmp_path / "first", "--steps", 3, threads=1)
    assert "planning" not in resumed.stdout + resumed.stderr
    assert "cached" not in resumed.stdout + resumed.stderr


@pytest.mark.slow  # a plan of the default recipe: most of half a minute on 2 cores
def test_a_new_plan_is_made_in_a_process_of_its_own_and_training_carries_nothing_of_it(
    tmp_path, monkeypatch
):
    """Planning the default recipe in the training process leaves it holding what the
    probes allocated (many MiB); made in a process of its own, the run's process only reads
    the answer, and memory.json says what it carried."""
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", "off")
    run = tmp_path / "run"
    proc = cli("train", "--steps", 1, "--budget", "300MB", "--no-tensorboard", "--out", run)
    assert "planning the micro-batch" in proc.stdout, proc.stdout
    memory = json.loads((run / "memory.json").read_text())
    assert 0 <= memory["carried"] < 4 * 2**20, memory
    plan = json.loads((run / "plan.json").read_text())
    assert plan["source"] == "planned" and plan["micro_size"] >= 1
    assert memory["peak"] <= plan["budget"]


def test_a_budget_too_small_is_refused_in_the_commands_flags_and_no_plan_is_written(tmp_path):
    cfg = TrainConfig.of(recipe="digits", budget="1KB", steps=1, out=str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        train(cfg, log=lambda *a, **k: None)
    text = str(err.value)
    assert text.startswith("budget 1000 B is too small for DigitsCNN"), text
    assert "--checkpointing auto" in text and "checkpointing='auto'" not in text
    assert not (tmp_path / "run" / "plan.json").exists()


@pytest.mark.slow  # make test keeps its 8 minutes
def test_a_terminal_that_reports_no_size_still_shows_progress(tmp_path):
    """A pty whose size is 0 x 0 (some ptys, `script`, containers): tqdm, given no rows,
    drew nothing at all; the bar and its loss and speed now show."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    args = ["--recipe", "digits", "--steps", "5", "--micro-batch", "16", "--no-guard"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradaccum", "train", *args, "--out", str(tmp_path / "run")],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.close(slave)
    out = b""
    while select.select([master], [], [], 120)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, out[-2000:]
    text = out.decode(errors="replace")
    assert "5/5" in text and "images/s" in text and "nats/image" in text, text[-2000:]
