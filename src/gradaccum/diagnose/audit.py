"""Audit any trainer's gradient accumulation: one accumulated window against the same samples
as one batch, with no gradaccum in the trainer's training code.

``ga.audit(trainer)`` takes the trainer as it is, a ``transformers.Trainer`` or any subclass
(TRL's included), runs one window the way its training loop does (its own ``get_batch_samples``
and ``training_step``: its loss, its normalization, its backward), reads the gradient its
optimizer would be handed, and compares it with the gradient of the same samples as one
batch under the trainer's own loss. Dropout is off for both (every ``nn.Dropout`` set to 0
while it runs), no optimizer steps, and the model's parameters are left as they were.

``ga.audit(lightning_trainer, module=..., data=...)`` does it for a Lightning ``Trainer``
with ``accumulate_grad_batches``: it runs the trainer's own ``fit`` on the module and data up
to its first optimizer step (the module's ``training_step`` and the trainer's loop and
callbacks, as configured) and stops it there, before the step; the large batch is the
window's micro-batches joined, through ``training_step`` (its loss, or ``loss / count``
where it returns gradaccum's ``exact_output``). The trainer has then run (and stopped) a
fit: build a new one to train.

``ga.audit(step=..., loss=..., model=..., micro_batches=...)`` does the same for a plain
loop: ``step(model, micro_batches)`` accumulates the window's gradient as the user's loop
does (without stepping), ``loss(model, batch)`` is the large batch's mean loss.

The result names the likely cause in words: a gradient N times the large batch's (a mean
per micro-batch that nothing divides by the accumulation steps), a model's auxiliary loss
left out of the trained loss (a mixture-of-experts model's router loss: the window matches
the large batch's gradient without it), micro-batches weighted equally whatever their item
counts, BatchNorm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.batchnorm import batchnorm_modules
from gradaccum.loss import router_loss_setting

__all__ = ["AuditResult", "audit"]

TOLERANCE = 1e-5  # relative error below which a window is the large batch's, in fp32


@dataclass(frozen=True)
class AuditResult:
    """What one audited window did against the same samples as one batch.

    ``relative_error``: |g - g_big| / |g_big| over every parameter; ``ratio``: the window's
    gradient projected on the large batch's, <g, g_big> / |g_big|^2 (1.0 when exact, N for a
    loss N times too large); ``cause``: the likely cause in words (None when it passes);
    ``micro_batches``: the window's; ``passed``: the error within ``tolerance``."""

    relative_error: float
    ratio: float
    passed: bool
    tolerance: float
    micro_batches: int
    cause: str | None

    @property
    def summary(self) -> str:
        head = (
            f"accumulation audit, one window of {self.micro_batches} micro-batches against "
            f"the same samples as one batch: relative error {self.relative_error:.2e}, "
            f"{self.ratio:.3g}x the large batch's gradient"
        )
        if self.passed:
            return f"{head}: PASS (within {self.tolerance:g})"
        return f"{head}: FAIL; {self.cause}"

    def __str__(self) -> str:
        return self.summary


def audit(
    trainer: Any = None,
    *,
    module: nn.Module | None = None,
    data: Any = None,
    step: Callable[[nn.Module, list[Any]], None] | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    model: nn.Module | None = None,
    micro_batches: list[Any] | None = None,
    tolerance: float = TOLERANCE,
) -> AuditResult:
    """Audit ``trainer`` (a ``transformers.Trainer`` or subclass; a Lightning ``Trainer``
    with its ``module`` and ``data``, a DataLoader or a LightningDataModule), or a plain
    loop given as ``step``, ``loss``, ``model`` and ``micro_batches`` (see the module's
    docstring)."""
    if trainer is not None:
        if hasattr(trainer, "accumulate_grad_batches") and hasattr(trainer, "fit"):
            if module is None or data is None:
                raise TypeError(
                    "audit of a Lightning Trainer needs module= (the LightningModule) and "
                    "data= (its training DataLoader or LightningDataModule)"
                )
            return _audit_lightning(trainer, module, data, tolerance)
        if not (hasattr(trainer, "training_step") and hasattr(trainer, "get_batch_samples")):
            raise TypeError(
                f"audit takes a transformers.Trainer (or a subclass) or a Lightning Trainer, "
                f"got {type(trainer).__name__}; for a plain loop give step=, loss=, model= "
                "and micro_batches="
            )
        return _audit_trainer(trainer, tolerance)
    missing = [
        n
        for n, v in (
            ("step", step),
            ("loss", loss),
            ("model", model),
            ("micro_batches", micro_batches),
        )
        if v is None
    ]
    if missing:
        raise TypeError(f"audit of a plain loop needs {', '.join(missing)}")
    micro_batches = list(micro_batches)

    def window() -> None:
        step(model, micro_batches)

    def big() -> torch.Tensor:
        return loss(model, _concat(micro_batches, {}))

    def equal() -> torch.Tensor:
        return sum(loss(model, mb) for mb in micro_batches) / len(micro_batches)

    return _compare(model, window, big, equal, len(micro_batches), tolerance)


def _audit_trainer(trainer: Any, tolerance: float) -> AuditResult:
    from gradaccum.integrations.transformers import is_preference_trainer, is_rl_trainer

    if is_rl_trainer(trainer):
        raise TypeError(
            "audit of a GRPOTrainer: its micro-batches are completions it generates inside "
            "training_step, so one window cannot be replayed as one batch; its mixin's "
            "exactness is measured in tests/integration/test_trl.py"
        )
    paired = is_preference_trainer(trainer)  # rows: the chosen completions, then the rejected
    steps = trainer.args.gradient_accumulation_steps
    iterator = iter(trainer.get_train_dataloader())
    batches, items = trainer.get_batch_samples(iterator, steps, trainer.args.device)
    model = trainer.model
    fills = {"labels": -100, "attention_mask": 0}
    pad = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    fills["input_ids"] = pad if pad is not None else 0
    reference = _reference_compute_loss(trainer)

    def window() -> None:
        # what the training loop sets for each window before its micro-batches
        trainer.current_gradient_accumulation_steps = len(batches)
        for mb in batches:
            trainer.training_step(model, mb, items)

    def mean_loss(batch: Any) -> torch.Tensor:
        out = reference(trainer, model, trainer._prepare_inputs(batch))
        return out[0] if isinstance(out, tuple) else out

    def big() -> torch.Tensor:
        if not paired:
            return mean_loss(_concat(batches, fills))
        halves = [_halves(mb) for mb in batches]  # every chosen row, then every rejected
        return mean_loss(_concat([h[0] for h in halves] + [h[1] for h in halves], fills))

    def equal() -> torch.Tensor:
        return sum(mean_loss(mb) for mb in batches) / len(batches)

    noise = getattr(trainer, "noise", None)
    saved = None if noise is None else noise.state_dict()
    try:
        return _compare(model, window, big, equal, len(batches), tolerance)
    finally:
        if saved is not None:
            noise.load_state_dict(saved)


class _WindowDone(Exception):
    """Raised by the audit's callback at the first optimizer step, to stop the fit there."""


def _audit_lightning(trainer: Any, module: nn.Module, data: Any, tolerance: float) -> AuditResult:
    """One window of the trainer's own fit, stopped before its optimizer step; the window's
    micro-batches, recorded as the loop hands them over, joined for the large batch."""
    if type(trainer).__module__.startswith("pytorch_lightning"):
        from pytorch_lightning import Callback, LightningDataModule
    else:
        from lightning.pytorch import Callback, LightningDataModule
    seen: list[Any] = []
    stopped = []

    class Capture(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            stopped.append(len(seen))  # the window's gradient is whole here: stop the fit
            raise _WindowDone

    def window() -> None:
        capture = Capture()
        trainer.callbacks.append(capture)  # last: after any callback that finishes the window
        try:
            if isinstance(data, LightningDataModule):
                trainer.fit(module, datamodule=data)
            else:
                trainer.fit(module, train_dataloaders=data)
        except _WindowDone:
            pass
        finally:
            trainer.callbacks.remove(capture)
        if not stopped:
            raise ValueError(
                f"the Lightning fit ended after {len(seen)} micro-batches without an optimizer "
                "step; give it at least accumulate_grad_batches batches"
            )

    def mean_loss(batch: Any) -> torch.Tensor:
        out = module.training_step(batch, 0)
        if isinstance(out, dict):
            loss = out["loss"]
            return loss / out["count"] if "count" in out else loss
        return out

    def big() -> torch.Tensor:
        return mean_loss(_concat(seen, {"labels": -100, "attention_mask": 0}))

    def equal() -> torch.Tensor:
        return sum(mean_loss(mb) for mb in seen) / len(seen)

    # the window's length is known once it has run
    return _compare(module, window, big, equal, lambda: stopped[0], tolerance)


def _reference_compute_loss(trainer: Any) -> Callable[..., Any]:
    """The trainer's own loss, as a mean over a batch: the first ``compute_loss`` in its
    class's order that is not gradaccum's (whose training loss is a sum)."""
    for cls in type(trainer).__mro__:
        if "compute_loss" in vars(cls) and not cls.__module__.startswith("gradaccum."):
            return vars(cls)["compute_loss"]
    raise TypeError(f"{type(trainer).__name__} has no compute_loss")


def _compare(
    model: nn.Module,
    window: Callable[[], None],
    big: Callable[[], torch.Tensor],
    equal: Callable[[], torch.Tensor],
    n: int | Callable[[], int],
    tolerance: float,
) -> AuditResult:
    """``n``: the window's micro-batches, or a function that tells them after the window."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    was_training = model.training
    try:
        with _no_dropout(model):
            _clear(params)
            model.train()
            window()
            got = _grads(params)
            _clear(params)
            big().backward()
            want = _grads(params)
            _clear(params)
            equal().backward()
            equal_weights = _grads(params)
            _clear(params)
            router = router_loss_setting(model)
            without_router = None
            if router is not None:  # the large batch as the model computes it without it
                with _no_router_loss(model):
                    big().backward()
                without_router = _grads(params)
                _clear(params)
    finally:
        model.train(was_training)
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(b)
    n = n() if callable(n) else n
    err = _rel(got, want)
    dot = sum(float((g.double() * w.double()).sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.double().square().sum()) for w in want)
    ratio = dot / norm if norm else float("nan")
    passed = err <= tolerance
    off_router = None if without_router is None else _rel(got, without_router)
    return AuditResult(
        err,
        ratio,
        passed,
        tolerance,
        n,
        None if passed else _cause(model, ratio, n, _rel(got, equal_weights), off_router),
    )


def _cause(
    model: nn.Module, ratio: float, n: int, off_equal: float, off_router: float | None = None
) -> str:
    if n > 1 and abs(ratio - n) <= 0.1 * n:
        return (
            f"the gradient is {ratio:.2f}x the large batch's with {n} micro-batches: the loss "
            "is a mean per micro-batch and nothing divides it by the accumulation steps (a "
            "compute_loss that ignores num_items_in_batch?)"
        )
    if off_router is not None and off_router <= 1e-4:
        setting = router_loss_setting(model)[0]
        return (
            "the model's auxiliary loss is not in the trained loss: the window's gradient is "
            f"the large batch's without the router loss ({setting}); train it as its own term "
            "of the window (gradaccum's transformers Trainer does, docs/losses.md)"
        )
    if off_equal <= 1e-4:
        return (
            "micro-batches are weighted equally whatever their item counts: each micro-batch's "
            "loss is its own mean, so one with few items (tokens, pairs) weighs as much as one "
            "with many"
        )
    norms = batchnorm_modules(model)
    if norms:
        return (
            f"{len(norms)} BatchNorm layer(s) normalize with each micro-batch's own "
            "statistics (gradaccum.convert_batchnorm, or GroupNorm, makes them exact)"
        )
    return "no known cause matched: the window's loss is not the large batch's mean"


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(
        float((g.double() - w.double()).square().sum()) for g, w in zip(got, want, strict=True)
    )
    den = sum(float(w.double().square().sum()) for w in want)
    return (num / den) ** 0.5 if den else float(num > 0)


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]


def _clear(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


@contextlib.contextmanager
def _no_router_loss(model: nn.Module) -> Iterator[None]:
    """The model's forward without its router loss: ``output_router_logits`` off in every
    config that turns it on, while it runs."""
    configs = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for c in (config, text):
            if getattr(c, "output_router_logits", False) is True:
                configs[id(c)] = c
    for c in configs.values():
        c.output_router_logits = False
    try:
        yield
    finally:
        for c in configs.values():
            c.output_router_logits = True


@contextlib.contextmanager
def _no_dropout(model: nn.Module) -> Iterator[None]:
    drops = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    rates = [m.p for m in drops]
    for m in drops:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(drops, rates, strict=True):
            m.p = p


def _halves(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A preference micro-batch's chosen rows and its rejected rows (its first and second
    halves), each a batch of the same keys."""
    parts = {k: v.chunk(2) if isinstance(v, torch.Tensor) else (v, v) for k, v in batch.items()}
    return {k: v[0] for k, v in parts.items()}, {k: v[1] for k, v in parts.items()}


def _concat(batches: list[Any], fills: dict[str, Any]) -> Any:
    """Micro-batches as one batch: tensors joined on dim 0, padded on dim 1 to the longest
    (``fills``: each key's pad value, 0 otherwise)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return _join([b for b in batches], 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_join([b[i] for b in batches], 0) for i in range(len(first)))
    return {
        k: _join([b[k] for b in batches], fills.get(k, 0)) if isinstance(v, torch.Tensor) else v
        for k, v in first.items()
    }


def _join(parts: list[torch.Tensor], fill: Any) -> torch.Tensor:
    if parts[0].dim() >= 2:
        longest = max(p.shape[1] for p in parts)
        parts = [
            torch.cat([p, p.new_full((p.shape[0], longest - p.shape[1], *p.shape[2:]), fill)], 1)
            if p.shape[1] < longest
            else p
            for p in parts
        ]
    return torch.cat(parts)
