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
    # the plan is shown whole (what was planned, and its probes), then the one-line refusal;
    # nothing of an export is printed
    assert (
        proc.stdout.startswith("effective batch 97: ") and "| micro-batch | probe |" in proc.stdout
    )
    assert "train_batch_size" not in proc.stdout and "accumulate_grad_batches" not in proc.stdout


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
