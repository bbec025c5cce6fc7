"""`gradaccum plan --export FRAMEWORK` as a user runs it: a real plan, then its export.

The digits recipe with live tensor bytes as the meter: the fastest plan, and deterministic,
so the budget decides the micro-batch the same way on every machine."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from helpers import cli, make_plan


@pytest.mark.slow
def test_plan_exports_a_deepspeed_config_that_multiplies_out_exactly():
    proc = cli(
        "plan",
        "--recipe",
        "digits",
        "--meter",
        "tensors",
        "--effective-batch",
        128,
        "--world-size",
        2,
        "--budget",
        "3MiB",
        "--precision",
        "bf16",
        "--export",
        "deepspeed",
        "--json",
        threads=1,
    )
    planned = json.loads(proc.stdout)
    assert planned["precision"] == "bf16"
    exported = planned["export"]
    config = exported["settings"]
    print(f"planned {planned['micro_sizes']} per rank; exported {json.dumps(config)}")
    assert exported["framework"] == "deepspeed"
    assert (
        config["train_batch_size"]
        == 128
        == (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2)
    )
    assert config["train_micro_batch_size_per_gpu"] <= planned["micro_size"]  # it fits
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert json.loads(exported["snippet"]) == config


@pytest.mark.slow
def test_an_effective_batch_with_no_equal_split_is_refused_in_one_line():
    # 97 is prime: any planned micro-batch between 2 and 96 leaves a smaller last one, and
    # no equal micro-batch from half the planned size up divides 97
    proc = cli(
        "plan",
        "--recipe",
        "digits",
        "--meter",
        "tensors",
        "--effective-batch",
        97,
        "--budget",
        "3MiB",
        "--export",
        "lightning",
        check=False,
        threads=1,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gradaccum: error: cannot export effective_batch 97 as equal"), last
    assert "per-rank batch 97 has no divisor" in last
    # the plan is shown whole on stderr (what was planned, and its probes), then the one-line
    # refusal; stdout, where the file would be, stays empty
    assert "effective batch 97: " in proc.stderr and "| micro-batch | probe |" in proc.stderr
    assert proc.stdout == ""


DEEPSPEED_WINDOW = textwrap.dedent(
    """
    import json, sys
    import torch, deepspeed

    config = json.loads(sys.stdin.read())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
    )
    dtype = next(engine.module.parameters()).dtype
    steps = []
    for _ in range(config["gradient_accumulation_steps"]):
        x = torch.randn(config["train_micro_batch_size_per_gpu"], 4, dtype=dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        steps.append(engine.global_steps)
    print(json.dumps({
        "optimizer": type(engine.optimizer).__name__,
        "dtypes": [str(d) for d in engine.get_data_types()],
        "steps": steps,
    }))
    """
)


@pytest.mark.slow  # DeepSpeed compiles its CPU shared-memory op first: over 100 s from nothing
def test_deepspeed_initializes_the_bf16_export_with_fp32_accumulation():
    """Without ZeRO, deepspeed.initialize refuses a bf16 model with grad_accum_dtype fp32
    (NotImplementedError "unsupported mix"); with the exported stage 1 it accumulates in fp32
    and steps once per window. One process on gloo, in a subprocess (its process group)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    ex = make_plan(12, micro=4, precision="bf16").export("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_WINDOW],
        input=ex.snippet,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["optimizer"] == "BF16_Optimizer"
    assert out["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert out["steps"] == [0, 0, 1]  # 3 micro-batches of 4: one optimizer step, at the end


# Every framework's file as a user makes it: `gradaccum plan --export F > FILE`, then read by
# the framework's own parser. One plan (digits, live tensor bytes: deterministic) measured
# once; the other frameworks read it from the plan cache.
DIGITS_64 = (
    "--recipe",
    "digits",
    "--meter",
    "tensors",
    "--effective-batch",
    64,
    "--budget",
    "3MiB",
)


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("plan-cache")


def _exported(framework, folder, cache):
    """The file a redirect of stdout makes, and stderr (what a person reads)."""
    file = folder / f"{framework}.out"
    with open(file, "w") as stdout:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gradaccum",
                "plan",
                *map(str, DIGITS_64),
                "--export",
                framework,
            ],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "GRADACCUM_PLAN_CACHE": str(cache)},
            timeout=300,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the plan and the export's arithmetic are on stderr, for the person
    assert "effective batch 64: " in proc.stderr and "| micro-batch | probe |" in proc.stderr
    assert f"{framework}: micro-batch " in proc.stderr
    return file, proc.stderr


def _split(stderr, framework):
    """(micro-batch, accumulation steps) as stderr's arithmetic line says them."""
    line = next(x for x in stderr.splitlines() if x.startswith(f"{framework}: micro-batch "))
    words = line.split()
    return int(words[2]), int(words[4])


@pytest.mark.slow  # a plan process each, and the framework's import
def test_deepspeed_export_redirected_is_its_config(tmp_path, plan_cache):
    from deepspeed.runtime.config import DeepSpeedConfig

    file, stderr = _exported("deepspeed", tmp_path, plan_cache)
    config = json.loads(file.read_text())  # strict JSON, nothing before or after it
    parsed = DeepSpeedConfig(config)
    micro, steps = _split(stderr, "deepspeed")
    assert parsed.train_batch_size == 64
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        micro,
        steps,
    )
    assert micro * steps == 64


@pytest.mark.slow  # a plan process each, and the framework's import
def test_transformers_export_redirected_is_training_arguments(tmp_path, plan_cache):
    from transformers import HfArgumentParser, TrainingArguments

    file, stderr = _exported("transformers", tmp_path, plan_cache)
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(file)
    micro, steps = _split(stderr, "transformers")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (micro, steps)
    assert micro * steps == 64 and not args.bf16 and not args.fp16


@pytest.mark.slow  # a plan process each, and the framework's import
def test_lightning_export_redirected_is_trainer_settings(tmp_path, plan_cache):
    import lightning as L
    import yaml

    file, stderr = _exported("lightning", tmp_path, plan_cache)
    text = file.read_text()
    settings = yaml.safe_load(text)
    assert set(settings) == {"trainer"}  # LightningCLI's --config form
    trainer = L.Trainer(**settings["trainer"], logger=False, enable_progress_bar=False)
    micro, steps = _split(stderr, "lightning")
    assert trainer.accumulate_grad_batches == steps and micro * steps == 64
    assert f"DataLoader(batch_size={micro})" in text  # the one setting of the user's own code


@pytest.mark.slow  # a plan process each, and the framework's import
def test_accelerate_export_redirected_is_accelerator_arguments(tmp_path, plan_cache):
    from accelerate import Accelerator

    file, stderr = _exported("accelerate", tmp_path, plan_cache)
    accelerator = Accelerator(**json.loads(file.read_text()))
    micro, steps = _split(stderr, "accelerate")
    assert accelerator.gradient_accumulation_steps == steps and micro * steps == 64
    assert accelerator.mixed_precision == "no"


@pytest.mark.slow  # a plan process each, and the framework's import
def test_export_to_writes_the_file_and_leaves_the_plan_on_stdout(tmp_path, plan_cache, monkeypatch):
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(plan_cache))
    target = tmp_path / "ds.json"
    proc = cli("plan", *DIGITS_64, "--export", "deepspeed", "--export-to", target, threads=1)
    assert proc.stdout.startswith("effective batch 64: ")
    assert proc.stdout.rstrip().endswith(f": {target}")
    assert json.loads(target.read_text())["train_batch_size"] == 64
