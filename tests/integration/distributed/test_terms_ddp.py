"""Named terms on 2 real gloo processes whose ranks hold different counts of every term (and
once none): each step's gradient and the term means against one process's full batch,
computed with torch alone (tests/terms.py's reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import terms
import torch
import workers
from helpers import TinyLM, make_model, max_rel_err, padded_lm_batch
from launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
import test_terms as case  # noqa: E402

TOL = {"float32": 1e-6, "float64": 1e-12}


def reference(dtype):
    model = make_model(TinyLM).to(dtype)
    opt = workers.optimizer(model.parameters())
    grads, means = [], []
    for step in range(len(workers.TERMS_STEPS)):
        batch = padded_lm_batch(seed=21 + step, n=12)
        opt.zero_grad(set_to_none=True)
        terms.reference(model, batch).backward()
        with torch.no_grad():
            means.append({k: v.item() for k, v in terms.reference_terms(model, batch).items()})
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads, means, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_terms_over_ranks_with_different_counts_equal_the_full_batch(tmp_path, kind, dtype):
    launch(workers.terms, kind, dtype, str(tmp_path))
    got = torch.load(tmp_path / f"terms-{kind}-{dtype}.pt", weights_only=True)
    grads, means, params = reference(getattr(torch, dtype))
    for step, (a, b) in enumerate(zip(got["grads"], grads, strict=True)):
        err = max_rel_err(a, b)
        assert err <= TOL[dtype], f"{kind} {dtype} step {step}: gradient error {err:.2e}"
    for a, b in zip(got["means"], means, strict=True):
        assert a == pytest.approx(b, rel=TOL[dtype] * 10)
    assert max_rel_err(got["params"], params) <= TOL[dtype] * 10


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_each_normalization_over_ranks_equals_its_full_batch_definition(tmp_path, dtype):
    """Per token, per sequence, per group (groups spanning the ranks), the constant
    normalizer and packed rows, each one window over 2 ranks with different rows and
    micro-batches, against its definition over the whole batch in one process
    (tests/unit/test_terms.py's)."""
    launch(workers.normalizations, dtype, str(tmp_path))
    got = torch.load(tmp_path / f"normalizations-{dtype}.pt", weights_only=True)
    batch = case.rl_batch(seed=7, groups=[3, 5, 1, 4])
    for name, (_, _, definition) in case.HELPERS.items():
        model = make_model(case.TokenMLP).to(getattr(torch, dtype))
        definition(case.token_losses(model, batch), batch).backward()
        want = {n: p.grad for n, p in model.named_parameters()}
        err = max_rel_err(got[name], want)
        print(f"{name} {dtype} on 2 ranks: {err:.1e}")
        assert err <= TOL[dtype], name
    # packed rows: the token mean and the per-sequence mean of the sequences unpacked
    seqs = case.sequences(seed=9, n=17)
    model = make_model(case.TokenMLP).to(getattr(torch, dtype))
    (
        case.unpacked_reference(model, seqs, per_sequence=False)
        + case.unpacked_reference(model, seqs, per_sequence=True)
    ).backward()
    err = max_rel_err(got["packed rows"], {n: p.grad for n, p in model.named_parameters()})
    print(f"packed rows {dtype} on 2 ranks: {err:.1e}")
    assert err <= TOL[dtype]
