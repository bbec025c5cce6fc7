"""`gradaccum plan --export FRAMEWORK` as a user runs it: a real plan, then its export.

The digits recipe with live tensor bytes as the meter: the fastest plan, and deterministic,
so the budget decides the micro-batch the same way on every machine."""

import json

from helpers import cli


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
    assert proc.stdout == ""  # nothing half-printed before the refusal
