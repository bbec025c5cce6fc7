"""gradaccum.planning.exports, Plan.export: each framework's own object, built from the
export, runs the effective batch exactly; a request that does not split into equal
micro-batches is refused with the numbers."""

import json

import pytest
import torch
from helpers import MLP, make_model, make_plan, mlp_loss, regression_batch

import gradaccum as ga
from gradaccum.planning.exports import FRAMEWORKS, equal_split

PRECISIONS = ("fp32", "bf16", "fp16")


# (effective, world, planned micro) -> the equal split: uniform windows keep the planned
# size; 100 at 13 (7 x 13 + 9) becomes 10 x 10; 96 over 2 ranks at 7 (48 = 6 x 7 + 6) is 6 x 8.
CASES = [
    ((64, 2, 8), (8, 4)),
    ((64, 1, 64), (64, 1)),
    ((100, 1, 13), (10, 10)),
    ((96, 2, 7), (6, 8)),
    ((6, 1, 3), (3, 2)),
]


@pytest.mark.parametrize(("request_", "expected"), CASES)
def test_equal_split_of_known_plans(request_, expected):
    assert equal_split(*request_) == expected


def test_equal_split_is_exact_or_refused_and_refuses_only_what_has_no_divisor():
    for effective in range(1, 121):
        for world in (1, 2, 3, 4):
            if effective % world:
                continue
            per_rank = effective // world
            for micro in range(1, per_rank + 1):
                # an independent search: every equal micro-batch from half the plan's up
                allowed = [d for d in range(1, micro + 1) if per_rank % d == 0 and 2 * d >= micro]
                if not allowed:
                    with pytest.raises(ValueError, match=f"effective_batch {effective} as equal"):
                        equal_split(effective, world, micro)
                    continue
                m, a = equal_split(effective, world, micro)
                assert m * a * world == effective
                assert m == max(allowed)


def test_a_batch_that_does_not_divide_over_the_ranks_is_refused_with_both_numbers():
    with pytest.raises(
        ValueError,
        match=r"^cannot export: effective_batch 97 does not divide over world_size 2 ranks "
        r"\(97 = 2 x 48 \+ 1\).*choose a multiple of 2$",
    ):
        make_plan(97, world=2, micro=8).export("deepspeed")


def test_a_window_with_no_equal_split_is_refused_with_the_nearest_batches_that_divide():
    plan = make_plan(194, world=2, micro=13)  # 97 per rank: prime
    assert plan.last_micro_size != plan.micro_size
    with pytest.raises(ValueError) as err:
        plan.export("transformers")
    msg = str(err.value)
    assert "\n" not in msg
    assert "effective_batch 194" in msg and "per-rank batch 97" in msg
    assert "no divisor from 7 to the planned micro-batch 13" in msg
    # 13 x 2 ranks = 26: 7 x 26 = 182 below, 8 x 26 = 208 above
    assert "effective_batch 182 or 208 divides at micro-batch 13 x 2 ranks" in msg
    for suggested in (182, 208):
        assert equal_split(suggested, 2, 13) == (13, suggested // 26)


def test_unknown_framework_and_precision_are_named_with_the_choices():
    with pytest.raises(ValueError) as err:
        make_plan(64, precision="fp8").export("keras")
    msg = str(err.value)
    assert "unknown framework 'keras'; choose one of transformers, lightning, accelerate, " in msg
    assert "precision must be one of fp32, bf16, fp16, got 'fp8'" in msg


def test_plan_records_its_precision_and_exports_from_a_real_plan():
    model = make_model(MLP)
    result = ga.plan(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        regression_batch(0, n=8),
        mlp_loss,
        effective_batch=24,
        budget="1GiB",
        precision="bf16",
        probe_sizes=[1, 2],
        meter="tensors",
    )
    assert result.precision == "bf16" and result.to_dict()["precision"] == "bf16"
    assert "effective batch 24" in result.summary()
    exported = result.export("deepspeed")
    config = exported.settings
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] == 24
    assert config["bf16"] == {"enabled": True}
    assert json.loads(exported.snippet) == config


def grid():
    """Uniform and non-uniform windows, one and two ranks, with and without checkpointing."""
    for precision in PRECISIONS:
        yield make_plan(64, world=1, micro=16, precision=precision)
        yield make_plan(200, world=2, micro=13, precision=precision, checkpointing=True)


def test_every_export_multiplies_out_to_the_effective_batch_and_names_its_arithmetic():
    for plan in grid():
        for framework in FRAMEWORKS:
            ex = plan.export(framework)
            assert ex.micro_size * ex.accumulation_steps * ex.world_size == plan.effective_batch
            assert plan.micro_size / 2 <= ex.micro_size <= plan.micro_size
            arithmetic = (
                f"micro-batch {ex.micro_size} x {ex.accumulation_steps} accumulation steps x "
                f"{plan.world_size} rank"
            )
            assert ex.comments[0].startswith(arithmetic), ex.comments[0]
            assert f"= {plan.effective_batch} samples per optimizer step" in ex.comments[0]
            assert f"# {ex.comments[0]}" in str(ex)
            json.dumps(ex.to_dict())  # the CLI's --json


# -- each framework's own object, built from the export ---------------------------------------


# the export writes gradient_checkpointing, the name from 4.46 (the extra's floor) on;
# transformers 5 calls it a deprecated alias of activation_checkpointing
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world", [1, 2])
def test_transformers_training_arguments(tmp_path, precision, world):
    transformers = pytest.importorskip("transformers")
    plan = make_plan(200, world=world, micro=13, precision=precision, checkpointing=True)
    ex = plan.export("transformers")
    # transformers refuses bf16 on CPU unless told it is CPU training on purpose
    cpu = {"use_cpu": True} if precision == "bf16" else {}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **ex.settings, **cpu)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * world == 200
    assert (args.bf16, args.fp16) == (precision == "bf16", precision == "fp16")
    assert args.gradient_checkpointing
    if world > 1:
        assert f"torchrun --nproc-per-node {world}" in ex.snippet


def test_transformers_snippet_runs_as_pasted(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    ex = make_plan(64, micro=16).export("transformers")
    scope = {}
    exec(ex.snippet, scope)
    args = scope["args"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 4)
    assert not args.gradient_checkpointing
    assert "gradaccum.integrations.transformers.Trainer" in ex.snippet


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_lightning_trainer(precision, world):
    L = pytest.importorskip("lightning")
    ex = make_plan(200, world=world, micro=13, precision=precision).export("lightning")
    # Built, not fitted: a CPU Trainer over 2 devices picks DDP but starts no process.
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, barebones=True, **ex.settings
    )
    assert trainer.world_size == world
    assert trainer.accumulate_grad_batches * ex.micro_size * trainer.world_size == 200
    assert trainer.precision == {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]


def test_lightning_fp16_and_the_snippet_as_pasted(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    # Lightning runs fp16 AMP on a GPU only (on CPU it switches to bf16): the setting alone.
    assert make_plan(64, precision="fp16").export("lightning").settings["precision"] == "16-mixed"
    ex = make_plan(64, micro=16, checkpointing=True).export("lightning")
    scope = {"train_dataset": torch.utils.data.TensorDataset(torch.arange(64))}
    exec(ex.snippet, scope)
    assert isinstance(scope["trainer"], L.Trainer)
    assert scope["trainer"].accumulate_grad_batches == 4
    assert scope["train_loader"].batch_size == 16
    assert "gradaccum.integrations.lightning.ExactAccumulation" in ex.snippet
    assert "gradaccum.enable_checkpointing(model)" in ex.snippet


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one AcceleratorState per process and refuses a second precision; its
    own test case resets it the same way."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(True)
    yield
    state.AcceleratorState._reset_state(True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_accelerate_accelerator(precision, fresh_accelerate_state):
    import accelerate

    ex = make_plan(200, world=2, micro=13, precision=precision).export("accelerate")
    accelerator = accelerate.Accelerator(**ex.settings)
    assert accelerator.gradient_accumulation_steps * ex.micro_size * 2 == 200
    assert accelerator.mixed_precision == {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]
    # the world size is the launcher's
    assert "accelerate launch --num_processes 2" in ex.snippet


def test_accelerate_snippet_runs_as_pasted(fresh_accelerate_state):
    ex = make_plan(64, micro=16, precision="bf16").export("accelerate")
    scope = {"train_dataset": torch.utils.data.TensorDataset(torch.arange(64))}
    exec(ex.snippet, scope)
    assert scope["accelerator"].gradient_accumulation_steps == 4
    assert scope["accelerator"].mixed_precision == "bf16"
    assert scope["train_loader"].batch_size == 16


# -- DeepSpeed: its documented invariant always; its own parser when it is installed ---------


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_config(precision, world):
    ex = make_plan(200, world=world, micro=13, precision=precision).export("deepspeed")
    config = ex.settings
    assert json.loads(ex.snippet) == config  # strict JSON, as Accelerate and HF load it
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world
    )
    assert config["train_batch_size"] == 200
    low = precision != "fp32"
    assert config.get("bf16") == ({"enabled": True} if precision == "bf16" else None)
    assert config.get("fp16", {}).get("enabled", False) == (precision == "fp16")
    # fp32 accumulation of bf16/fp16 gradients, which DeepSpeed honours under ZeRO only
    assert config.get("data_types") == ({"grad_accum_dtype": "fp32"} if low else None)
    assert (config.get("zero_optimization", {}).get("stage", 0) >= 1) == low


@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepspeed_parses_the_config_and_the_pasted_file(precision, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig checks the batch triple against the data-parallel world size, which is
    # 1 without an initialized process group: one rank here.
    ex = make_plan(100, micro=13, precision=precision).export("deepspeed")
    path = tmp_path / "ds_config.json"
    path.write_text(ex.snippet)
    for parsed in (DeepSpeedConfig(ex.settings), DeepSpeedConfig(str(path))):
        assert parsed.train_batch_size == 100
        assert parsed.train_micro_batch_size_per_gpu == ex.micro_size == 10
        assert parsed.gradient_accumulation_steps == ex.accumulation_steps == 10
        assert parsed.bfloat16_config.enabled == (precision == "bf16")
        assert parsed.float16_config.enabled == (precision == "fp16")
        assert parsed.grad_accum_dtype == (None if precision == "fp32" else "fp32")
        assert parsed.zero_optimization_stage == (0 if precision == "fp32" else 1)
