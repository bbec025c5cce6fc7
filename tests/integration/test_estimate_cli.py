"""`gradaccum plan --device cuda` on a machine without a GPU: the fake-tensor estimate, from the
command (in this process: its main, exit status and output; the trace in its own process)."""

from __future__ import annotations

import json

import pytest
from test_faults import in_process

pytestmark = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="with a GPU here, --device cuda measures"
)


def tiny(tmp_path, model_type="llama", **extra):
    config = {
        "model_type": model_type,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        **extra,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_recipe_estimated_for_cuda_gives_its_numbers_in_bytes():
    done = in_process("plan", "--device", "cuda", "--recipe", "digits", "--micro-batch", "8",
                      "--effective-batch", "32", "--gpu", "t4", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["micro_batch"] == 8 and result["per_window"] == 4
    assert result["estimate"] is True and result["gpu"] == "t4"
    assert result["reserved"] >= result["allocated"] > result["parts"]["parameters"] > 0
    assert result["total"] == result["reserved"] + result["context"]


@pytest.mark.slow  # a fresh process tracing a model: about 15 s on a quiet machine
def test_an_hf_config_with_lora_is_estimated_and_says_what_it_assumed(tmp_path):
    done = in_process("plan", "--device", "cuda", "--hf-model", tiny(tmp_path), "--lora", "2",
                      "--seq-len", "16", "--micro-batch", "2", "--precision", "bf16",
                      "--budget", "24GB")  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "ESTIMATE for cuda" in text and "not measured" in text
    assert "LoRA r=2" in text and "16 tokens per sequence" in text
    assert "autocast: CUDA's bf16 op lists" in text
    for row in ("allocated", "reserved", "device total", "optimizer state", "activations"):
        assert row in text


@pytest.mark.slow  # a fresh process tracing a model: about 15 s on a quiet machine
def test_the_largest_micro_batch_under_the_budget_is_searched():
    done = in_process("plan", "--device", "cuda", "--recipe", "digits", "--effective-batch",
                      "64", "--budget", "2GB", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["largest"] == result["micro_batch"] == 64 and result["total"] <= 2 * 10**9


@pytest.mark.slow  # a fresh process tracing a model: about 15 s on a quiet machine
def test_an_op_the_trace_cannot_run_ends_in_one_line_naming_op_and_module(tmp_path):
    # a mixture of experts: its experts' grouped matmul has no fake kernel for fp32 inputs
    folder = tiny(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    done = in_process("plan", "--device", "cuda", "--hf-model", folder, "--micro-batch", "2",
                      "--seq-len", "8")  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]  # after any progress lines
    assert line.startswith("gradaccum: error: ") and "Traceback" not in done.stderr
    assert "cannot run aten." in line and "(in model.layers.0." in line


def test_estimate_options_without_the_estimate_are_refused():
    done = in_process("plan", "--micro-batch", "4")
    assert done.returncode == 2
    assert "--micro-batch apply to the estimate: add --device cuda or --estimate" in done.stderr


def test_an_8bit_optimizer_and_data_parallel_buckets_are_estimated_and_said():
    done = in_process("plan", "--device", "cuda", "--recipe", "digits", "--micro-batch", "8",
                      "--optimizer", "adamw8bit", "--world-size", "2", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assumed = " ".join(result["assumptions"])
    assert "bitsandbytes' AdamW8bit by its documented state layout" in assumed
    assert "world size 2: each process holds the whole model in DistributedDataParallel" in assumed
    assert result["parts"]["optimizer state"] > 0 and result["unified"] == 0


def tiny_vit(tmp_path):
    config = {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "image_size": 32,
        "patch_size": 8,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "id2label": {str(i): str(i) for i in range(10)},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.slow  # a fresh process tracing a model: about 15 s on a quiet machine
def test_an_image_classifier_is_estimated_with_the_head_its_config_names(tmp_path):
    done = in_process("plan", "--device", "cuda", "--hf-model", tiny_vit(tmp_path),
                      "--micro-batch", "4", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "vit image classification from its config" in result["assumptions"][0]
    assert "32x32 images" in result["assumptions"][0]
    assert result["allocated"] > result["parts"]["parameters"] > 0


@pytest.mark.slow  # a fresh process: about 10 s on a quiet machine
def test_lora_on_a_classifier_head_is_refused_in_one_line(tmp_path):
    done = in_process("plan", "--device", "cuda", "--hf-model", tiny(tmp_path, "bert"),
                      "--task", "sequence-classification", "--lora", "2")  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]  # after any progress lines (a loaded machine)
    assert line.startswith("gradaccum: error: ") and "Traceback" not in done.stderr
    assert "--lora with a sequence-classification head is not modelled" in line


def test_a_second_identical_estimate_answers_from_the_plan_cache(tmp_path, monkeypatch):
    from gradaccum.app import plan_cache

    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path))
    args = ("plan", "--device", "cuda", "--recipe", "digits", "--micro-batch", "8", "--json")
    first = in_process(*args)
    assert first.returncode == 0, first.stderr
    traced = json.loads(first.stdout)
    assert traced["cached"] is None
    (entry,) = [p for p in tmp_path.glob("*.json") if '"estimate traces"' not in p.read_text()]
    # the stored estimate, changed (its checksum made again): what a cache hit answers
    stored = json.loads(entry.read_text())
    stored["plan"]["allocated"] += 512
    body = {"key": stored["key"], "plan": stored["plan"]}
    entry.write_text(json.dumps({**body, "sha256": plan_cache.checksum(body)}))
    second = in_process(*args)
    assert second.returncode == 0, second.stderr
    hit = json.loads(second.stdout)
    assert hit["cached"] == str(entry) and hit["allocated"] == traced["allocated"] + 512
    assert "the estimate is the cached one" in second.stderr
    # --replan traces again
    replanned = json.loads(in_process(*args, "--replan").stdout)
    assert replanned["cached"] is None and replanned["allocated"] == traced["allocated"]


def test_what_the_estimate_does_not_model_is_refused_in_one_line():
    done = in_process("plan", "--device", "cuda", "--shard", "fsdp")
    assert done.returncode == 2 and "shard fsdp needs --world-size 2 or more, got 1" in (
        done.stderr
    )
    done = in_process("plan", "--shard", "fsdp", "--world-size", "2")
    assert done.returncode == 2 and "shard fsdp applies to the estimate" in done.stderr
    done = in_process("plan", "--device", "cuda", "--quantize", "nf4")
    assert done.returncode == 2 and "quantize needs --lora R" in done.stderr
    assert done.stderr.strip().count("\n") == 0


@pytest.mark.slow  # a fresh process tracing a model: about 15 s on a quiet machine
def test_lora_on_a_4bit_base_is_estimated_and_says_what_it_modelled(tmp_path):
    done = in_process("plan", "--device", "cuda", "--hf-model", tiny(tmp_path), "--lora", "2",
                      "--quantize", "nf4", "--double-quant", "--precision", "bf16",
                      "--micro-batch", "2", "--seq-len", "16", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assumed = " ".join(result["assumptions"])
    assert "bitsandbytes' Linear4bit nf4 with double quantization" in assumed
    assert "prepare_model_for_kbit_training's fp32 cast not applied" in assumed


def test_fsdp_is_estimated_per_rank_with_the_sync_the_plan_would_choose():
    args = ("plan", "--device", "cuda", "--recipe", "gpt", "--micro-batch", "2",
            "--effective-batch", "8", "--gpu", "t4", "--json")  # fmt: skip
    ddp = json.loads(in_process(*args, "--world-size", "4").stdout)
    done = in_process(*args, "--world-size", "4", "--shard", "fsdp")
    assert done.returncode == 0, done.stderr
    sharded = json.loads(done.stdout)
    assert sharded["sync"] == "window" and sharded["per_window"] == 1
    assert "FSDP2 (fully_shard) on 4 repeated blocks and the root" in " ".join(
        sharded["assumptions"]
    )
    # a quarter of the optimizer state (give or take the padding and the allocator's blocks)
    quarter = ddp["parts"]["optimizer state"] / 4
    assert quarter <= sharded["parts"]["optimizer state"] <= 1.05 * quarter
    assert sharded["allocated"] < ddp["allocated"]


def test_fsdp_falls_back_to_micro_sync_where_window_sync_does_not_fit():
    import torch

    import gradaccum as ga
    from gradaccum.app.recipes import get_recipe

    recipe = get_recipe("gpt")

    def total(sync):
        return ga.estimate(recipe.build_model, lambda p: torch.optim.AdamW(p, lr=1e-4),
                           recipe.sample_batch, recipe.loss_fn, micro_size=2, micro_batches=2,
                           gpu="t4", world_size=2, shard="fsdp", sync=sync).total  # fmt: skip

    window, micro = total("window"), total("micro")
    assert micro < window  # the whole unsharded gradient held against its shard
    done = in_process("plan", "--device", "cuda", "--recipe", "gpt", "--micro-batch", "2",
                      "--effective-batch", "8", "--gpu", "t4", "--world-size", "2", "--shard",
                      "fsdp", "--budget", str((window + micro) // 2), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["sync"] == "micro" and result["total"] == micro
    assert "(window) does not fit the budget" in " ".join(result["assumptions"])


def test_a_deepspeed_zero_2_config_is_estimated_as_deepspeed_holds_the_run(tmp_path):
    """--deepspeed FILE as a Hugging Face run passes it: bf16 'auto' (the run's precision),
    AdamW from the file. Against the plain bf16 estimate of the same run: the
    optimizer state is the float32 master with its two moments (12 B a parameter, not 8), the
    parameters are bf16, and the assumptions say what was read."""
    config = {"bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 65536}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(config))
    args = ("plan", "--device", "cuda", "--recipe", "gpt", "--micro-batch", "2",
            "--effective-batch", "4", "--gpu", "t4", "--precision", "bf16", "--json")  # fmt: skip
    plain = json.loads(in_process(*args).stdout)
    done = in_process(*args, "--deepspeed", str(tmp_path / "ds.json"))
    assert done.returncode == 0, done.stderr
    zero = json.loads(done.stdout)
    assert "DeepSpeed ZeRO stage 2 (bf16, rank 0 of 1)" in " ".join(zero["assumptions"])
    states = zero["parts"]["optimizer state"] / plain["parts"]["optimizer state"]
    assert 1.45 <= states <= 1.55, states  # 12 B against AdamW's 8 B a parameter
    assert zero["parts"]["parameters"] < 0.55 * plain["parts"]["parameters"]


def test_a_deepspeed_config_the_estimate_does_not_model_is_refused_in_one_line(tmp_path):
    (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    done = in_process("plan", "--device", "cuda", "--recipe", "gpt", "--micro-batch", "2",
                      "--deepspeed", str(tmp_path / "z3.json"))  # fmt: skip
    assert done.returncode != 0 and "ZeRO stage 3 is not modelled" in done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    done = in_process("plan", "--recipe", "gpt", "--deepspeed", str(tmp_path / "z3.json"))
    assert done.returncode == 2 and "apply to the estimate" in done.stderr


def test_bf16_true_holds_every_weight_and_optimizer_state_in_bf16():
    """--precision bf16-true (Lightning's and litgpt's): the parameters and AdamW's two
    moments half of float32's, and said; the measured plan does not take it."""
    args = ("plan", "--device", "cuda", "--recipe", "gpt", "--micro-batch", "2",
            "--effective-batch", "4", "--gpu", "t4", "--json")  # fmt: skip
    fp32 = json.loads(in_process(*args).stdout)
    done = in_process(*args, "--precision", "bf16-true")
    assert done.returncode == 0, done.stderr
    true = json.loads(done.stdout)
    assert "bf16-true: every parameter" in " ".join(true["assumptions"])
    for part in ("parameters", "optimizer state"):
        half = fp32["parts"][part] / 2
        assert half <= true["parts"][part] <= 1.02 * half, (part, true["parts"], fp32["parts"])
    done = in_process("plan", "--recipe", "gpt", "--precision", "bf16-true")
    assert done.returncode == 2 and "bf16-true applies to the estimate" in done.stderr
