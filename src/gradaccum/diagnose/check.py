"""check(): does the accumulated step equal the large batch's, on this model and data?

The same batch, two ways: one forward/backward over all of it (mean loss), and the
Accumulator's window over micro-batches of ``micro_size``. Dropout is switched off for the
comparison (its masks depend on how the batch is cut; that is randomness, not a flaw): the
model runs in eval mode but for its BatchNorm/InstanceNorm layers, which keep their mode.
Relative error per parameter, the worst layers, a verdict, and the modules that make the
two differ, with why. The verdict tells rounding from a real difference: both gradients are
measured against the full batch computed in float64, and the accumulated one passes when
its error is within ``ROUNDING_HEADROOM`` times the error the full batch itself makes in the
model's dtype (its rounding floor, measured), or within the dtype's tolerance. A deep model's
fp32 rounding can exceed any fixed tolerance; a real difference (BatchNorm's micro-batch
statistics) is orders of magnitude above it. The modules that make them differ: BatchNorm and
SyncBatchNorm in train mode and InstanceNorm with running statistics by type, and any other
module whose output for a sample changes with the other samples in its batch, found by
comparing each module's outputs in the two runs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradaccum.batching import split
from gradaccum.batchnorm import batchnorm_modules
from gradaccum.checkpoint import preserved_rng
from gradaccum.engine import Accumulator, LossFn
from gradaccum.sync import one_process

__all__ = ["CheckResult", "ROUNDING_HEADROOM", "TOLERANCES", "check", "float64_batch"]

# Relative error (per parameter, L2) that rounding alone stays under, per parameter dtype.
TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1.6e-2,
    torch.float16: 1e-3,
}

BATCHNORM_WHY = (
    "normalizes with the mean and variance of the micro-batch it sees (train "
    "mode), not of the whole batch; convert_batchnorm(model) or eval mode fixes "
    "the forward, batchnorm_momentum() only its running statistics"
)
INSTANCENORM_WHY = (
    "updates running statistics once per micro-batch (its normalization is "
    "per sample, so gradients are unaffected); batchnorm-style momentum "
    "differs from one full-batch update"
)
FOUND_WHY = "its output for a sample changes with the other samples in its batch (measured)"

# How far the accumulated gradient may be from the float64 full batch, in units of the
# model-dtype full batch's own distance from it: summing micro-batches rounds in another
# order, so its error is of the same size, not the same value.
ROUNDING_HEADROOM = 10.0


@dataclass
class CheckResult:
    passed: bool
    tolerance: float
    dtype: str
    max_error: float
    errors: dict[str, float]  # relative error per parameter
    worst: list[tuple[str, float]]
    culprits: list[tuple[str, str, str]]  # (module name, type, why)
    micro_batches: int
    dropout_disabled: int
    notes: list[str] = field(default_factory=list)
    rounding: float = 0.0  # the full batch's own worst error in its dtype, against float64

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        bound = f"tolerance for {self.dtype}: {self.tolerance:.0e}"
        if self.rounding:
            bound = (
                f"the full batch's own rounding in {self.dtype}: {self.rounding:.2e}, so up to "
                f"{max(self.tolerance, ROUNDING_HEADROOM * self.rounding):.1e} is rounding"
            )
        lines = [
            f"{verdict}: the accumulated gradient ({self.micro_batches} micro-batches) "
            f"{'equals' if self.passed else 'differs from'} the full batch's: worst relative "
            f"error {self.max_error:.2e} ({bound})",
            "worst parameters:",
            *[f"  {name:40s} {err:.2e}" for name, err in self.worst],
        ]
        if self.culprits:
            lines.append("modules that make accumulation differ from the large batch:")
            grouped: dict[tuple[str, str], list[str]] = {}
            for name, kind, why in self.culprits:
                grouped.setdefault((kind, why), []).append(name)
            for (kind, why), names in grouped.items():  # each explanation once
                shown = ", ".join(names[:6]) + (
                    f" and {len(names) - 6} more" if len(names) > 6 else ""
                )
                lines.append(f"  {shown} ({kind}): {why}")
        if self.dropout_disabled:
            lines.append(
                f"({self.dropout_disabled} dropout modules, and any other dropout the model "
                "applies in train mode, were off for the comparison)"
            )
        lines += self.notes
        return "\n".join(lines)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(b.double()))
    diff = float(torch.linalg.vector_norm(a.double() - b.double()))
    return diff / denom if denom > 0 else diff


class _Outputs:
    """Forward hooks recording each module's outputs, to find batch-dependent modules."""

    def __init__(self, model: nn.Module) -> None:
        self.records: dict[str, list[torch.Tensor]] = {}
        self.handles = [
            m.register_forward_hook(self._hook(name))
            for name, m in model.named_modules()
            if name and not list(m.children())  # leaves: the first to differ is the cause
        ]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.dim() > 0:
                self.records.setdefault(name, []).append(out.detach().clone())

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@one_process()  # a check in one process, whatever group it runs in
def check(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_size: int,
    *,
    tolerance: float | None = None,
) -> CheckResult:
    """Compare the full-batch gradient of ``batch`` with the accumulated one over
    micro-batches of ``micro_size``, both against the full batch in float64. The model's
    parameters, buffers (BatchNorm running statistics), modes and random state are left as
    they were. ``tolerance``: the bound itself (relative error per parameter), instead of
    the larger of the dtype's tolerance and ``ROUNDING_HEADROOM`` x the measured rounding."""
    micro = split(batch, micro_size)
    if len(micro) < 2:
        raise ValueError(
            f"micro_size {micro_size} leaves the batch whole; choose a size "
            "smaller than the batch so there is something to compare"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    dtype = params[0].dtype
    tol = tolerance if tolerance is not None else TOLERANCES.get(dtype, 1e-5)
    # The float64 reference: the same model and batch in double precision, from the same
    # state (a copy made before anything runs), in the same modes.
    reference = None if dtype == torch.float64 else copy.deepcopy(model).double()
    names = {id(p): n for n, p in model.named_parameters()}
    saved_state = copy.deepcopy(model.state_dict())
    modes = {m: m.training for m in model.modules()}
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    norms = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    statistics_layers = [m for m in model.modules() if isinstance(m, norms) and m.training]
    if any(p.grad is not None for p in params):
        raise RuntimeError(
            "check() needs the model's gradients cleared first "
            "(optimizer.zero_grad(set_to_none=True))"
        )
    # dropout is off, but a model may draw random numbers elsewhere
    with preserved_rng():
        try:
            # Dropout's masks depend on how the batch is cut: randomness, not a flaw. Every
            # module goes to eval mode (nn.Dropout, and attention that reads self.training
            # for a functional dropout, as Hugging Face models do), except the normalization
            # layers whose train mode is exactly what the audit looks for.
            model.eval()
            for m in statistics_layers:
                m.train()
            exact = None
            if reference is not None:
                exact = _full_gradient(reference, float64_batch(batch), loss_fn, modes_of=model)
                del reference
            # 1. the full batch: its mean loss, through torch alone
            full_out = _Outputs(model)
            loss_sum, count = loss_fn(model, batch)
            (loss_sum / count).backward()
            full_out.remove()
            full = {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}
            for p in params:
                p.grad = None
            model.load_state_dict(saved_state)  # BatchNorm saw the batch once; undo that
            # 2. the accumulated window, through the Accumulator (a step of zero length)
            micro_out = _Outputs(model)
            optimizer = torch.optim.SGD(params, lr=0.0)
            seen: dict[str, torch.Tensor] = {}
            optimizer.register_step_pre_hook(
                lambda opt, *_: seen.update(
                    {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}
                )
            )
            result = Accumulator(model, optimizer).step(micro, loss_fn)
            micro_out.remove()
            if not result.stepped:
                raise ValueError(f"the accumulated window was skipped ({result.skipped})")
        finally:
            model.load_state_dict(saved_state)
            for m, training in modes.items():
                m.train(training)
            for p in params:
                p.grad = None

    # A parameter whose true gradient is zero (a bias right before a normalization that
    # removes it) has rounding noise for a gradient; measured against its own zero norm the
    # noise looks like a 100% error. Its error is taken against 1% of the whole gradient.
    truth = exact if exact is not None else full
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in truth.values()))
    floor = 1e-2 * total

    def error(grads: dict[str, torch.Tensor]) -> dict[str, float]:
        return {
            n: float(torch.linalg.vector_norm(grads[n].double() - g.double()))
            / max(float(torch.linalg.vector_norm(g.double())), floor)
            for n, g in truth.items()
            if n in grads
        }

    errors = error(seen)
    rounding = max(error(full).values(), default=0.0) if exact is not None else 0.0
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    max_error = worst[0][1] if worst else 0.0
    bound = max(tol, ROUNDING_HEADROOM * rounding) if tolerance is None else tol
    culprits = _culprits(model, full_out.records, micro_out.records, max(bound, 1e-4))
    return CheckResult(
        passed=max_error <= bound,
        tolerance=tol,
        dtype=str(dtype).replace("torch.", ""),
        max_error=max_error,
        errors=errors,
        worst=worst,
        culprits=culprits,
        micro_batches=len(micro),
        dropout_disabled=len(dropouts),
        rounding=rounding,
    )


def float64_batch(batch: Any) -> Any:
    """The batch with its floating-point tensors in float64 (ids and labels as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: float64_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(float64_batch(v) for v in batch)
    return batch


def _full_gradient(model: nn.Module, batch: Any, loss_fn: LossFn, modes_of: nn.Module):
    """The full batch's gradient of ``model`` (a float64 copy), run in the modes of the
    model it copies (dropout off, normalization layers as they are)."""
    for mine, theirs in zip(model.modules(), modes_of.modules(), strict=True):
        mine.train(theirs.training)
    loss_sum, count = loss_fn(model, batch)
    (loss_sum / count).backward()
    return {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


def _culprits(model: nn.Module, full: dict, micro: dict, tol: float) -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    named = dict(model.named_modules())
    for name, bn in batchnorm_modules(model):
        if bn.training:
            found.append((name, type(bn).__name__, BATCHNORM_WHY))
    for name, m in named.items():
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            found.append((name, type(m).__name__, INSTANCENORM_WHY))
    listed = {n for n, _, _ in found}
    # The first leaf, in forward order, whose outputs differ between the two runs is where
    # the batch leaks in; everything after it differs because of it.
    for name, outs in full.items():
        parts = micro.get(name)
        if not parts or len(outs) != 1:
            continue
        try:
            joined = torch.cat(parts)
        except RuntimeError:
            continue  # outputs of different shapes (e.g. trimmed sequences): not comparable
        if joined.shape != outs[0].shape or _rel(joined, outs[0]) <= max(tol, 1e-4):
            continue
        if name not in listed:
            found.append((name, type(named[name]).__name__, FOUND_WHY))
        break
    return found
