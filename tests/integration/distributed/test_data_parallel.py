"""DDP and FSDP2 on 2 real gloo processes: one exact step per window, one reduction per step.

Each launch is 2 spawned processes on 127.0.0.1 with a free port and OMP_NUM_THREADS=1,
killed (and failed) after 60 s.
"""

from __future__ import annotations

import pytest
import torch
import workers
from helpers import TinyLM, lm_reference, make_model, max_rel_err, padded_lm_batch
from launch import launch

PARAM_TOL = 1e-5  # fp32 rounding, relative


def reference(steps: int):
    """One process, the whole global batch, torch's mean loss: no gradaccum. Returns the
    parameters after ``steps`` steps, each step's gradient and each step's loss."""
    model = make_model(TinyLM)
    opt = workers.optimizer(model.parameters())
    grads, losses = [], []
    for step in range(steps):
        loss = lm_reference(model, padded_lm_batch(seed=11 + step, n=workers.GLOBAL_BATCH))
        losses.append(loss.item())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    runs = {}
    for kind in ("ddp", "fsdp"):
        launch(workers.train, kind, str(out))
        runs[kind] = torch.load(out / f"{kind}.pt", weights_only=False)
    return runs


@pytest.mark.parametrize("scenario", sorted(workers.SCENARIOS))
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_three_steps_equal_single_process_full_batch(trained, kind, scenario):
    expected, expected_grads, expected_losses = reference(3)
    got = trained[kind][scenario]
    for step, (a, b) in enumerate(zip(got["grads"], expected_grads, strict=True)):
        err = max_rel_err(a, b)
        assert err <= PARAM_TOL, f"{kind} {scenario} step {step}: gradient error {err:.2e}"
    err = max_rel_err(got["params"], expected)
    assert err <= PARAM_TOL, f"{kind} {scenario}: parameter relative error {err:.2e}"
    # the reported loss is the global batch's mean, not one rank's
    for step, (a, b) in enumerate(zip(got["losses"], expected_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs full batch {b}"
    assert got["state"].optimizer_steps == 3
    start = {n: p.detach() for n, p in make_model(TinyLM).named_parameters()}
    assert max_rel_err(got["params"], start) > 1e-3  # training moved them


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_one_gradient_reduction_per_optimizer_step(tmp_path, kind):
    n = 4
    for mode in ("window", "micro"):
        launch(workers.count, kind, mode, n, str(tmp_path))
    window = torch.load(tmp_path / f"count-{kind}-window-{n}.pt", weights_only=True)
    micro = torch.load(tmp_path / f"count-{kind}-micro-{n}.pt", weights_only=True)
    assert window["steps"] == micro["steps"] == 3
    assert window["reductions"] == 3, window  # one per optimizer step
    assert micro["reductions"] == 3 * n, micro  # against one per micro-batch when forced


def test_ddp_gradients_differ_before_the_last_micro_batch_and_match_after(tmp_path):
    launch(workers.ddp_grads_across_ranks, str(tmp_path))
    spread = torch.load(tmp_path / "spread.pt", weights_only=True)
    assert spread["before"] > 1e-3, spread  # each rank holds only its own data's gradient
    assert spread["after"] == 0.0, spread  # the reduction made them identical
    assert spread["stepped"]
    no_last, after_last, noise = spread["errors"]
    assert "without a micro-batch marked last=True" in no_last
    assert "after the one marked last=True" in after_last
    assert not spread["in_window"]  # both misuses dropped their window
    assert "noise=NoiseScale(...) with sync='micro'" in noise and "DDP" in noise


@pytest.mark.slow
def test_noise_scale_under_ddp_matches_the_closed_form(tmp_path):
    """Local prefixes before the reduction plus the global batch after it: the same estimate
    the single-process test checks (tests/test_diagnose.py), same tolerance."""
    launch(workers.noise_scale, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"noise-{rank}.pt", weights_only=True)
        for micro, (b_simple, g2) in got["found"].items():
            print(
                f"rank {rank}, micro {micro}: B_simple {b_simple:.1f}, analytic "
                f"{got['analytic']:.1f}"
            )
            assert b_simple == pytest.approx(got["analytic"], rel=0.15), micro
            assert g2 == pytest.approx(got["true_g2"], rel=0.15), micro


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_forward_outside_the_context_is_refused_and_the_pad_source_released(tmp_path, kind):
    launch(workers.forward_outside_and_padding, kind, str(tmp_path))
    got = torch.load(tmp_path / f"outside-{kind}.pt", weights_only=True)
    assert len(got["errors"]) == 1, got
    assert "ran inside `with acc.micro_batch(...)`" in got["errors"][0]
    assert "leave the ranks' gradients different" in got["errors"][0]
    assert got["dropped"]  # the refused window left no gradient behind
    assert got["stepped"] and got["spread"] == 0.0  # and the ranks stay identical
    assert got["released"]  # the micro-batch is gone once its window ended
    assert got["pad_shape"][0] == 1  # only one sample is kept to pad later windows


def test_an_oom_on_one_rank_is_replayed_by_both_and_the_step_stays_exact(tmp_path):
    """Rank 1 alone runs out of memory in window 2 (at any micro-batch above 2 samples): both
    ranks drop that window and replay it smaller, twice (5 -> 3 -> 2), grow back together,
    and end where the run without the fault ends. The launcher fails the test after 60 s:
    a rank left waiting for the other is a failure, not a stuck job."""
    launch(workers.oom_replay, str(tmp_path))
    got = torch.load(tmp_path / "oom.pt", weights_only=False)
    assert got["replays"] == [0, 2, 0, 0]  # rank 0's count: it replayed without failing
    # grown back after each clean window: to 4 (rank 0's window 3 holds 6-sample micro-batches),
    # then to the sizes given
    assert got["caps"] == [None, 2, 4, None]
    assert got["plain_replays"] == [0, 0, 0, 0]
    err = max_rel_err(got["injected"], got["plain"])
    assert err <= 1e-6, f"the replayed run is {err:.2e} from the run without the fault"
    start = {n: p.detach() for n, p in make_model(TinyLM).named_parameters()}
    assert max_rel_err(got["plain"], start) > 1e-3  # training moved them
    fsdp, micro = got["errors"]
    assert "every forward gathers parameters across ranks" in fsdp
    assert "sync='micro' with OOM replay under DDP" in micro


def test_fp32_accumulation_of_bf16_gradients_under_ddp_and_fsdp2(tmp_path):
    """N = 32 micro-batches per rank. The error of the gradient handed to the optimizer
    against the exact mean, where the mean is first rounded to the handed dtype (the one
    rounding no accumulation avoids): fp32 accumulation at least 100x below plain bf16."""
    launch(workers.bf16_accumulation, str(tmp_path))
    got = torch.load(tmp_path / "bf16.pt", weights_only=False)
    exact = got["exact"]

    def error(handed: dict[str, torch.Tensor]) -> float:
        num = sum(
            float((handed[k].double() - exact[k].to(handed[k].dtype).double()).square().sum())
            for k in exact
        )
        den = sum(float(exact[k].square().sum()) for k in exact)
        return (num / den) ** 0.5

    for kind in ("ddp", "fsdp"):
        fp32, bf16 = error(got[f"{kind}-fp32"]), error(got[f"{kind}-bf16"])
        assert bf16 > 1e-3, (kind, bf16)  # bf16 accumulation over 32 terms does lose bits
        assert fp32 * 100 <= bf16, f"{kind}: fp32 accumulation {fp32:.2e}, bf16 {bf16:.2e}"
    assert got["ddp-fp32"]["head.weight"].dtype == torch.bfloat16  # bf16 parameters
    assert got["fsdp-fp32"]["head.weight"].dtype == torch.float32  # FSDP2's fp32 shards


@pytest.mark.slow
def test_the_planner_picks_window_or_micro_sync_for_fsdp2_from_the_budget(tmp_path, monkeypatch):
    """plan(sync="auto") on 2 FSDP2 ranks: window sync under a roomy budget; micro sync under
    one where the whole unsharded gradient held between micro-batches does not fit but one
    shard does. Each plan's per-rank prediction against the peak a training run measures
    on each rank: within 15%."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned processes
    launch(workers.plan_sync, str(tmp_path), timeout=240)  # it plans twice on each rank
    got = torch.load(tmp_path / "plan_sync.pt", weights_only=False)
    assert got["roomy"]["plan"].sync == "window"
    assert got["squeezed"]["plan"].sync == "micro"
    assert "window does not fit at micro-batch 1" in got["squeezed"]["plan"].notes[-1]
    assert "it fits, with one reduce-scatter per window" in got["roomy"]["plan"].notes[-1]
    for name in ("roomy", "squeezed"):
        predicted = got[name]["plan"].predicted_peak
        for rank, measured in enumerate(got[name]["measured"]):
            err = abs(measured - predicted) / predicted
            assert err <= 0.15, f"{name}, rank {rank}: measured {measured}, predicted {predicted}"
        assert got[name]["untouched"]  # planning leaves the model as it was


def test_fp16_under_ddp_prescales_every_rank_alike(tmp_path):
    """Ranks whose first micro-batches count 2 tokens and many: each pre-scaled its loss by a
    power of two from its own first count, and DDP added gradients of different scales (the
    handed gradient was 2.1x off the full batch's). The ranks now agree on the largest first
    count (one all-reduce per window, fp16 under DDP only): the step is the full batch's
    within fp16's rounding."""
    launch(workers.fp16_first_counts, str(tmp_path))
    got = torch.load(tmp_path / "fp16.pt", weights_only=True)
    batch = padded_lm_batch(seed=3, n=12)
    batch["labels"][6, 3:] = -100
    model = make_model(TinyLM)
    lm_reference(model, batch).backward()
    err = max_rel_err(got["grads"], {n: p.grad for n, p in model.named_parameters()})
    print(f"fp16 under DDP, first counts 2 and many: {err:.1e}")
    assert got["stepped"][-1] and err <= 1e-2
