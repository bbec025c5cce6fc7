"""The kinds of run (gradaccum.app.kinds), in-process: what each does with a batch, that a
pipeline's window and a replica's window compute the same step, and that the loop and the
report never ask which kind they run."""

import ast
from pathlib import Path

import pytest
import torch
from helpers import TinyLM, capture_step_grads, make_model, max_rel_err, padded_lm_batch

import gradaccum as ga
from gradaccum.app import kinds
from gradaccum.app.config import Distributed, TrainConfig
from gradaccum.app.kinds import Pipelined, Replicated, RunKind, Sharded

APP = Path(kinds.__file__).parent


def test_a_replica_trains_its_share_of_the_batch_and_one_process_all_of_it():
    batch = padded_lm_batch(seed=1)  # 13 sequences
    alone, second = Replicated(0, 1), Replicated(1, 2)
    assert alone.local(batch) is batch and alone.across(None) == ""
    share = second.local(batch)["input_ids"]
    assert torch.equal(share, ga.shard(batch, 1, 2)["input_ids"])
    assert second.across(None) == " on each of 2 processes"
    assert not second.evaluates() and Replicated(0, 2).evaluates()
    assert Sharded(1, 2).evaluates()  # FSDP2's ranks gather blocks together: all evaluate


def test_pipeline_stages_share_one_batch_and_evaluate_through_the_chain():
    stage = Pipelined(1, 2, Distributed(pipeline_stages=2))
    stage.chained = chain = torch.nn.Identity()  # (wrap() makes it from the GPT's stage)
    batch = padded_lm_batch(seed=1)
    assert stage.replicas == 1 and stage.local(batch) is batch
    assert stage.across(None) == " through 2 pipeline stages (1f1b)"
    assert stage.evaluates() and stage.evaluated(torch.nn.Linear(1, 1)) is chain


def test_a_pipelined_step_and_a_replicated_step_hand_the_optimizer_one_gradient(
    one_process_group,
):
    """The loop calls ``kind.step`` whatever the kind: a replica cuts the batch into
    micro-batches of 4 for its Accumulator, a one-stage pipeline's schedule cuts it into 4
    chunks (4, 3, 3, 3 of 13). Both must give the optimizer the same gradient."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.pipeline import PipelineWindow

    batch = padded_lm_batch(seed=2)

    def loss(model, mb):
        return ga.causal_lm_loss(model(mb["input_ids"]), mb["labels"])

    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(opt, model)
    result = Replicated(0, 1).step(ga.Accumulator(model, opt), batch, 4, loss)
    replicated = seen[0]

    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(opt, model)
    window = PipelineWindow(
        PipelineStage(model, 0, 1, torch.device("cpu")), opt, ga.causal_lm_loss, 4
    )
    one = Distributed(pipeline_stages=1, pipeline_schedule="gpipe")
    piped = Pipelined(0, 1, one).step(window, batch, 4, None)
    assert piped.count == result.count
    assert max_rel_err(seen[0], replicated) <= 1e-5


# What the loop would have to name to branch on the kind of run.
KIND_WORDS = {
    "stages",
    "pipeline_stages",
    "sharded",
    "together",
    "shard",
    "world",
    "PipelineWindow",
    "Sharded",
    "Pipelined",
    "Replicated",
}


def kind_words(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names & KIND_WORDS


LOOP_AND_COMPONENTS = [
    "trainer.py",
    "run.py",
    "lr.py",
    "stops.py",
    "evaluation.py",
    "exporter.py",
    "boundary.py",
    "checkpoints.py",
    "report/sink.py",
    "report/summary.py",
    "build.py",
]


@pytest.mark.parametrize("module", LOOP_AND_COMPONENTS)
def test_the_build_the_loop_and_the_report_never_ask_which_kind_of_run_they_run(module):
    # (PipelineWindow may be named in a type annotation, which is not a branch; the build
    # hands the job's process count, ``world``, to RunKind.of.)
    assert kind_words(APP / module) - {"PipelineWindow", "world"} == set()


def test_the_configuration_and_the_job_make_the_kind_and_a_misfit_says_how_to_launch():
    assert type(RunKind.of(TrainConfig.of(), 0, 1)) is Replicated
    assert type(RunKind.of(TrainConfig.of(shard="fsdp"), 0, 2)) is Sharded
    assert type(RunKind.of(TrainConfig.of(pipeline_stages=2), 1, 2)) is Pipelined
    with pytest.raises(ValueError, match="launch it with torchrun --nproc-per-node N"):
        RunKind.of(TrainConfig.of(shard="fsdp"), 0, 1)
    with pytest.raises(ValueError, match="this job has 1 process;"):
        RunKind.of(TrainConfig.of(pipeline_stages=2), 0, 1)


def test_the_check_sees_a_branch_on_the_kind(tmp_path):
    branchy = tmp_path / "branchy.py"
    branchy.write_text("if run.stages > 1:\n    pass\n")
    assert kind_words(branchy) == {"stages"}
