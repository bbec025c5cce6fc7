"""Sync.of sees through the wrappers a model comes in (torch.compile's OptimizedModule here;
Lightning Fabric's and PEFT's in tests/integration/distributed/test_wrappers.py, which
imports those frameworks) down to the DDP or FSDP2 module whose sync it controls, and refuses
what it cannot see through. DDP and FSDP2 run here in a process group of one (gloo); the
2-process runs are in tests/integration/distributed/."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import MLP, capture_step_grads, make_model, mlp_loss, regression_batch, split_sizes
from torch.nn.parallel import DistributedDataParallel

import gradaccum as ga
from gradaccum.sync import DDPSync, FSDPSync, Sync, is_sharded


class Holder(torch.nn.Module):
    """A module of a class gradaccum does not know, running the module it holds."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    # the eager backend: dynamo's OptimizedModule and its tracing, without a C++ compiler
    return torch.compile(model, backend="eager")


def test_a_plain_model_is_one_processs_and_says_nothing_outside_a_group():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sync = Sync.of(make_model(MLP))
        assert type(sync) is Sync and not sync.distributed and sync.via == ()
        assert type(Sync.of(compiled(make_model(MLP)))) is Sync


def test_a_plain_model_in_a_group_of_one_says_nothing(one_process_group):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(Sync.of(make_model(MLP))) is Sync


def test_torch_compile_around_ddp_is_seen_through_and_ddp_inside_compile_taken_as_it_is(
    one_process_group,
):
    net = make_model(MLP)
    ddp = DistributedDataParallel(net)
    sync = Sync.of(compiled(ddp))
    assert isinstance(sync, DDPSync) and sync.model is ddp and sync.inner is net
    assert sync.via == ("OptimizedModule",)
    assert repr(sync) == "Sync(ddp, mode='window', world=1, via=OptimizedModule)"
    inside = DistributedDataParallel(compiled(make_model(MLP)))
    sync = Sync.of(inside)
    assert isinstance(sync, DDPSync) and sync.model is inside and sync.via == ()


def test_a_window_through_compiled_ddp_is_the_full_batch_and_saves_the_plain_module(
    one_process_group,
):
    net = make_model(MLP)
    model = compiled(DistributedDataParallel(net))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handed = capture_step_grads(optimizer, net)
    acc = ga.Accumulator(model, optimizer)
    batch = regression_batch(seed=3)
    result = acc.step(split_sizes(batch, [4, 9]), mlp_loss)
    assert result.count == 13
    reference = make_model(MLP)
    torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
    for name, p in reference.named_parameters():
        assert (handed[0][name] - p.grad).abs().max() <= 1e-6, name
    # the checkpoint holds the module inside the wrappers: it loads without them
    assert acc.state_dict()["model"].keys() == net.state_dict().keys()


def test_fsdp2_under_torch_compile_is_seen_through(one_process_group):
    from torch.distributed.fsdp import fully_shard

    net = make_model(MLP)
    fully_shard(net)
    sync = Sync.of(compiled(net))
    assert isinstance(sync, FSDPSync) and sync.model is net and sync.via == ("OptimizedModule",)
    assert is_sharded(compiled(net)) and is_sharded(net)  # what the planner asks
    assert not is_sharded(compiled(DistributedDataParallel(make_model(MLP))))


def test_a_module_of_unknown_class_holding_ddp_is_refused_in_one_line_naming_it(
    one_process_group,
):
    model = Holder(DistributedDataParallel(make_model(MLP)))
    with pytest.raises(
        ValueError, match=r"^Holder holds a DistributedDataParallel module at 'inner'"
    ) as e:
        ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "\n" not in str(e.value)
    # below a wrapper gradaccum knows, too: the message says where
    with pytest.raises(ValueError, match=r"^Holder \(inside OptimizedModule\) holds a Distrib"):
        Sync.of(compiled(model))
    # deeper inside: the path to the DDP module
    with pytest.raises(ValueError, match=r"at 'inner\.inner'"):
        Sync.of(Holder(model))


def test_a_module_holding_fully_shard_modules_but_not_sharded_itself_is_refused(
    one_process_group,
):
    from torch.distributed.fsdp import fully_shard

    net = make_model(MLP)
    fully_shard(net.net[0])  # a unit, but not the root the Accumulator is handed
    with pytest.raises(
        ValueError, match=r"^MLP holds a fully_shard's FSDPLinear module at 'net\.0'"
    ):
        Sync.of(net)


def test_fsdp1_is_refused_even_inside_a_known_wrapper(one_process_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's own deprecation notice
        model = FullyShardedDataParallel(make_model(MLP), device_id=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"^the model is a FullyShardedDataParallel: .*fully_shard"
    ):
        Sync.of(model)
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel \(inside OptimizedModule\)"):
        Sync.of(compiled(model))
