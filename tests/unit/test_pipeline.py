"""PipelineWindow's refusals (its exactness runs in 2 processes: tests/integration/distributed/
test_pipeline_parallel.py)."""

import pytest
import torch

import gradaccum as ga
from gradaccum.pipeline import PipelineWindow


def optimizer():
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 4, "schedule": "zero-bubble"}, "schedule must be one of gpipe, 1f1b"),
        ({"micro_batches": 0}, "micro_batches must be a positive integer, got 0"),
        ({"micro_batches": 2.5}, "micro_batches must be a positive integer, got 2.5"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineWindow(None, optimizer(), lambda out, y: (out.sum(), 1), **kwargs)


def test_what_precision_cannot_do_through_a_pipeline_is_refused():
    bf16_params = torch.optim.SGD(torch.nn.Linear(2, 2).bfloat16().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="low-precision gradients cannot be moved into fp32"):
        PipelineWindow(None, bf16_params, lambda out, y: (out.sum(), 1), 2, precision="bf16")
    plain = ga.Precision("fp16", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="needs a ShardedGradScaler over the pipeline's group"):
        PipelineWindow(None, optimizer(), lambda out, y: (out.sum(), 1), 2, precision=plain)


# -- the built-in GPT cut into stages ------------------------------------------------------------


def gpt(layers: int = 4):
    from gradaccum.app.recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(max_len=16, d_model=16, n_heads=2, n_layers=layers))


@pytest.mark.parametrize(("stages", "blocks"), [(2, [2, 2]), (3, [2, 1, 1]), (4, [1, 1, 1, 1])])
def test_gpt_stages_chained_are_the_gpt(stages, blocks):
    from gradaccum.app.recipes.gpt import GPTStage

    model = gpt()
    parts = [GPTStage(model, i, stages) for i in range(stages)]
    assert [len(p.blocks) for p in parts] == blocks
    ids = torch.randint(0, 256, (3, 16))
    x = ids
    for part in parts:
        x = part(x)
    assert torch.equal(x, model(ids))
    # Every parameter name is the GPT's; together they are its state_dict.
    together = {k: v for p in parts for k, v in p.state_dict().items()}
    assert together.keys() == model.state_dict().keys()
    assert parts[0].tied()[0] is model.tok.weight and parts[-1].tied()[0] is model.head.weight
    assert all(p.tied() == [] for p in parts[1:-1])


def test_a_gpt_splits_into_at_most_its_blocks():
    from gradaccum.app.recipes.gpt import GPTStage

    with pytest.raises(ValueError, match="a GPT of 2 blocks splits into 1 to 2 stages, not 3"):
        GPTStage(gpt(2), 0, 3)


# -- the planner's choice of the number of micro-batches ------------------------------------------


def test_the_planner_takes_the_fewest_micro_batches_whose_bubble_is_small():
    from gradaccum.planning.pipeline import plan_micro_batches

    # 2 stages: a bubble of 1/(m + 1) is at most 20% from m = 4 on.
    plan = plan_micro_batches(16, 2, "1f1b", 1000, 10.0, budget=10**6)
    assert (plan.micro_batches, plan.micro_size, plan.bubble) == (4, 4, 0.2)
    # 1F1B holds min(m, 2) micro-batches of 16 / m at once: 2 x 4 samples of 10 bytes.
    assert plan.predicted == 1000 + 2 * 4 * 10.0
    assert "bubble 20%" in plan.summary() and "<-" in plan.summary()
    # 4 stages: m >= 12 for 20%; 12 does not divide 16, so 16.
    assert plan_micro_batches(16, 4, "gpipe", 1000, 10.0, budget=10**6).micro_batches == 16


def test_memory_raises_the_number_of_micro_batches_under_1f1b_only():
    from gradaccum.planning.pipeline import plan_micro_batches

    # 1F1B at m = 4 needs 1000 + 8 x 100 = 1800 bytes; at m = 8, 1000 + 2 x 2 x 100 = 1400.
    plan = plan_micro_batches(16, 2, "1f1b", 1000, 100.0, budget=1500, margin=0.0)
    assert plan.micro_batches == 8 and plan.predicted == 1400
    # GPipe holds every micro-batch at once: 1000 + 16 x 100 whatever m is.
    with pytest.raises(ValueError, match="at least 2.5 KiB.*try schedule='1f1b'"):
        plan_micro_batches(16, 2, "gpipe", 1000, 100.0, budget=1500, margin=0.0)


def test_a_stage_measures_its_parameters_and_the_activations_it_saves():
    from gradaccum.app.recipes.gpt import GPTStage
    from gradaccum.planning.pipeline import measure_stage

    part = GPTStage(gpt(), 1, 2)  # the last stage: input of the residual stream, logits out
    static, per_sample = measure_stage(part, part.sample_input, lambda out: out.sum())
    weights = sum(p.numel() for p in part.parameters()) * 4
    assert static == weights * 4  # parameters, gradients, AdamW's two states
    assert per_sample > 16 * 16 * 4  # at least the input it received


def test_a_pipeline_run_outside_torchrun_is_refused_in_one_line(tmp_path):
    from gradaccum.app import TrainConfig, train

    cfg = TrainConfig.of(pipeline_stages=2, out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"^--pipeline-stages 2 runs one stage per process: "):
        train(cfg, log=lambda *a: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"recipe": "digits"}, "pipeline_stages splits the built-in GPT only"),
        ({"pipeline_stages": 5}, "the GPT has 4 blocks, so at most 4 stages"),
        ({"batch_schedule": "steps:3=128"}, "needs a constant batch"),
        ({"micro_batch": 24}, "micro_batch 24 does not divide effective_batch 64"),
        ({"pipeline_schedule": "zb"}, "pipeline_schedule must be one of gpipe, 1f1b"),
    ],
)
def test_what_a_pipeline_run_does_not_do_is_named(options, message):
    from gradaccum.app import TrainConfig

    cfg = TrainConfig.of(**{"pipeline_stages": 2, **options})
    assert any(message in p for p in cfg.problems()), cfg.problems()
