"""A model that reaches the Accumulator inside another framework's wrapper, on 2 real gloo
processes: Lightning Fabric's ``_FabricModule``, torch.compile's ``OptimizedModule`` and what
accelerate.prepare returns (OptimizedModule around DDP, with a dynamo backend) are seen
through (one gradient reduction per window, the count summed over the ranks,
the full batch's gradient), a wrapper of unknown class around DDP is refused, and a model that
is not distributed under a process group of 2 says so.

One launch of 2 spawned processes runs every case (tests/integration/distributed/launch.py:
127.0.0.1, a free port, OMP_NUM_THREADS=1, killed and failed after 60 s). PEFT's models and
a wrapper whose forward skips its DDP are checked in this process, in a group of one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import wrapper_workers as w
from helpers import MLP, make_model, mlp_loss, regression_batch, split_sizes
from launch import launch
from torch.nn.parallel import DistributedDataParallel

import gradaccum as ga
from gradaccum.sync import DDPSync, Sync

TOL = 1e-6  # max abs difference from the full batch: fp32 rounding


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("wrappers")
    launch(w.run, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def full_batch() -> tuple[list[dict[str, torch.Tensor]], list[float], dict[str, torch.Tensor]]:
    """One process, each window's whole global batch, torch's mean loss, SGD: no gradaccum.
    Each step's gradient and loss, and the parameters at the end."""
    model = make_model(MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR)
    grads, losses = [], []
    for window in range(len(w.WINDOWS)):
        x, y = w.window_batch(window)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("case", ["fabric", "compiled", "accelerate"])
def test_a_wrapped_ddp_model_reduces_once_per_window_and_matches_the_full_batch(ranks, case):
    grads, losses, params = full_batch()
    for rank, seen in enumerate(r[case] for r in ranks):
        assert seen["sync"].startswith("Sync(ddp"), (case, rank, seen["sync"])
        # one all-reduce of the gradient per window, not one per micro-batch
        assert seen["reductions"] == len(w.WINDOWS), (case, rank, seen["reductions"])
        # the count is the global batch's (6 + 7, 5 + 8), on every rank
        assert seen["counts"] == [w.GLOBAL_BATCH] * len(w.WINDOWS), (case, rank, seen["counts"])
        for step, (got, want) in enumerate(zip(seen["grads"], grads, strict=True)):
            err = max_abs(got, want)
            print(f"{case} ({seen['wrapper']}) rank {rank} step {step}: gradient {err:.1e} off")
            assert err <= TOL, f"{case} rank {rank} step {step}: gradient {err:.2e} off"
        for got, want in zip(seen["losses"], losses, strict=True):
            assert abs(got - want) <= TOL * abs(want), (case, rank, got, want)
        assert max_abs(seen["params"], params) <= TOL


def test_a_wrapper_of_unknown_class_around_ddp_is_refused_in_one_line(ranks):
    for seen in ranks:
        message = seen["unknown"]
        assert message != "accepted"
        assert "\n" not in message and "Holder" in message, message
        assert "DistributedDataParallel" in message, message


def test_a_model_that_is_not_distributed_under_a_group_of_2_says_so_once(ranks):
    for seen in ranks:
        # built twice at one place and once at another: one warning for each place
        assert len(seen["plain"]) == 2, seen["plain"]
        message = seen["plain"][0]
        # issued from the line that built the Accumulator
        assert message.startswith("wrapper_workers.py: LocalModelWarning: "), message
        assert "\n" not in message and "MLP" in message and "2 processes" in message, message
        # none where one process's model is meant: one_process(), ga.check
        assert seen["meant"] == [], seen["meant"]


def test_peft_under_ddp_and_around_it_is_seen_through(one_process_group):
    peft = pytest.importorskip("peft")

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["net.0", "net.2"]))

    adapted = lora(make_model(MLP))
    assert type(Sync.of(adapted)) is Sync  # PEFT alone is one process's
    ddp = DistributedDataParallel(adapted)
    sync = Sync.of(ddp)
    assert isinstance(sync, DDPSync) and sync.model is ddp and sync.inner is adapted
    sync = Sync.of(torch.compile(ddp, backend="eager"))
    assert isinstance(sync, DDPSync) and sync.model is ddp and sync.via == ("OptimizedModule",)
    inside = DistributedDataParallel(make_model(MLP))
    sync = Sync.of(lora(inside))  # PeftModel > LoraModel > DDP
    assert isinstance(sync, DDPSync) and sync.model is inside
    assert sync.via == ("PeftModel", "LoraModel"), sync.via


def test_a_known_wrapper_whose_forward_skips_its_ddp_is_refused_at_the_first_backward(
    one_process_group,
):
    """DDP decides in its forward whether the backward communicates: a wrapper (here a
    subclass of Fabric's) whose forward runs the module under the DDP instead cannot be
    controlled, and the first micro-batch says so, naming both."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.fabric.wrappers import _FabricModule

    class Shortcut(_FabricModule):
        def forward(self, x):
            return self._original_module(x)  # past the DDP

    net = make_model(MLP)
    strategy = Fabric(accelerator="cpu", devices=1).strategy
    model = Shortcut(DistributedDataParallel(net), strategy, original_module=net)
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=w.LR))
    with pytest.raises(RuntimeError, match=r"the forward of Shortcut ran but did not run the Dis"):
        acc.step(split_sizes(regression_batch(seed=1), [6, 7]), mlp_loss)
