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
loop: ``step(model, micro_batches)`` runs the window as the user's loop does, and the
gradient compared is the one its optimizer is handed (a loop that steps is stopped at its
``optimizer.step()``, before anything changes: a ``ga.Accumulator``'s ``step()`` or
``end_window()`` included), or the one it leaves in ``.grad`` when it does not step;
``loss(model, batch)`` is the large batch's mean loss. The large batch is the micro-batches
joined: as they are where their shapes agree, else padded on dim 1 to the longest by
PyTorch's conventions (an integer labels tensor with cross-entropy's ignore index -100, a
mask and the rest with 0), a padding the audit first checks changes no micro-batch's own
loss; where none does, it refuses in one line and asks for ``pad=`` (each key's or
position's pad value) or ``join=`` (a function joining the micro-batches), never giving a
verdict on a batch it could not build.

The result names the likely cause in words and, for each cause it knows, the fix in one
line (the class or argument to use, and where the docs say more): a gradient N times the
large batch's (a mean per micro-batch that nothing divides by the accumulation steps), a
gradient the large batch's times a known factor (a Trainer that counted a causal LM's
labels before the shift), a model's auxiliary loss left out of the trained loss (a
mixture-of-experts model's router loss: the window matches the large batch's gradient
without it), micro-batches weighted equally whatever their item counts, BatchNorm.

Each framework's part (running its window its own way, its loss as a mean, its fixes) is an
``AuditWindow`` built beside that framework's integration (``gradaccum.integrations``:
``transformers.audit_window``, ``lightning.audit_window``); this module imports no framework,
and dispatches to them by what the trainer has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.batching import join_batches
from gradaccum.batchnorm import batchnorm_modules
from gradaccum.integrations.adapter import AuditWindow
from gradaccum.integrations.router import router_loss_setting

__all__ = ["FIXES", "AuditResult", "AuditWindow", "audit", "compare", "join_batches"]

TOLERANCE = 1e-5  # relative error below which a window is the large batch's, in fp32


@dataclass(frozen=True)
class AuditResult:
    """What one audited window did against the same samples as one batch.

    ``relative_error``: |g - g_big| / |g_big| over every parameter; ``ratio``: the window's
    gradient projected on the large batch's, <g, g_big> / |g_big|^2 (1.0 when exact, N for a
    loss N times too large); ``cause``: the likely cause in words (None when it passes);
    ``micro_batches``: the window's; ``passed``: the error within ``tolerance``; ``fix``:
    what to do about the cause, one line with a doc link (None when it passes); ``kind``:
    the cause's name (a key of ``FIXES``: "unknown" when no known cause matched);
    ``headline``: the cause in a few words, how ``cause`` begins (None when it passes).
    ``summary``: the verdict in one line (the relative error, PASS or FAIL, the cause in a
    few words), then indented lines: why, what was compared, the fix."""

    relative_error: float
    ratio: float
    passed: bool
    tolerance: float
    micro_batches: int
    cause: str | None
    fix: str | None = None
    kind: str | None = None
    headline: str | None = None

    @property
    def summary(self) -> str:
        head = f"accumulation audit, relative error {self.relative_error:.2e}"
        compared = (
            f"  compared: one window of {self.micro_batches} micro-batches, run as the trainer "
            "runs it, against the same samples as one batch under its loss (dropout off)"
        )
        if self.passed:
            return f"{head}: PASS (within {self.tolerance:g})\n{compared}"
        headline = self.headline or self.cause
        why = self.cause.removeprefix(f"{headline}: ") if self.headline else ""
        lines = [f"{head}: FAIL; {headline}"]
        lines += [f"  why: {why}"] if why else []
        if self.fix:
            first, *rest = self.fix.split("\n")
            lines += [compared, f"  fix: {first}", *(f"    {line}" for line in rest)]
        else:
            lines += [compared]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary


# The causes the audit knows, and the fix for a plain loop (an adapter gives its framework's).
FIXES = {
    "mean_per_micro_batch": "sum each micro-batch's loss and divide once by the window's item "
    "count: ga.Accumulator(model, optimizer).step(micro_batches, loss_fn) with loss_fn "
    "returning (loss_sum, count) (docs/api.md)",
    "labels_before_shift": "count a causal LM's labels after the shift, as the loss does: "
    "ga.causal_lm_loss(logits, labels) returns the sum and that count (docs/losses.md)",
    "ragged_window": "sum each micro-batch's loss and divide once by the window's own item "
    "count, whatever its length: ga.Accumulator(model, optimizer).step(micro_batches, "
    "loss_fn) (docs/api.md)",
    "router_loss": "train the model's router loss as its own term of the window, with its "
    "own count: a named term {'aux': (sum, routed rows, coefficient)} (docs/losses.md)",
    "equal_weights": "weigh each micro-batch by its items: sum its loss and divide once by the "
    "window's item count (ga.Accumulator, loss_fn returning (loss_sum, count); docs/api.md)",
    "batchnorm": "gradaccum.convert_batchnorm(model), or GroupNorm, makes them exact "
    "(docs/diagnostics.md#batchnorm)",
    "unknown": "check that the loss is a sum over items divided once by the window's count, "
    "and that nothing in it couples the batch's samples (in-batch negatives, a sort: "
    "docs/losses.md); ga.check(model, batch, loss_fn, micro_size) tests gradaccum's own step",
}


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
    pad: dict[Any, Any] | None = None,
    join: Callable[[list[Any]], Any] | None = None,
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
            from gradaccum.integrations import lightning

            return compare(lightning.audit_window(trainer, module, data), tolerance)
        if not (hasattr(trainer, "training_step") and hasattr(trainer, "get_batch_samples")):
            raise TypeError(
                f"audit takes a transformers.Trainer (or a subclass) or a Lightning Trainer, "
                f"got {type(trainer).__name__}; for a plain loop give step=, loss=, model= "
                "and micro_batches="
            )
        from gradaccum.integrations import transformers

        return compare(transformers.audit_window(trainer), tolerance)
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
    joined = join or joiner(model, loss, micro_batches, pad)

    def window() -> None:
        with handed(model):
            step(model, micro_batches)

    def big() -> torch.Tensor:
        return loss(model, joined(micro_batches))

    def equal() -> torch.Tensor:
        return sum(loss(model, mb) for mb in micro_batches) / len(micro_batches)

    fixes = {k: f"{v}{_where(step)}" for k, v in FIXES.items() if k != "unknown"}
    return compare(AuditWindow(model, window, big, equal, len(micro_batches), fixes), tolerance)


class _Handed(Exception):  # noqa: N818 - not an error: the gradient handed to the optimizer
    pass


@contextlib.contextmanager
def handed(model: nn.Module) -> Iterator[None]:
    """Run a user's window up to its optimizer's step, if it takes one: at the step the
    gradient handed over is in ``.grad`` and the window stops there, nothing stepped."""
    params = list(model.parameters())
    mine = {id(p) for p in params}
    seen: list[torch.Tensor | None] = []

    def stop(optimizer, args, kwargs):
        if any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            seen.extend(None if p.grad is None else p.grad.detach().clone() for p in params)
            raise _Handed  # what handles it (an Accumulator clears its window) runs after

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(stop)
    try:
        yield
    except _Handed:
        for p, grad in zip(params, seen, strict=True):
            p.grad = grad
    finally:
        hook.remove()


_LABELS = ("labels", "label", "targets", "target", "y")
_MASKS = ("attention_mask", "mask", "padding_mask")


def joiner(
    model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor], batches: list[Any],
    pad: dict[Any, Any] | None = None,
) -> Callable[[list[Any]], Any]:  # fmt: skip
    """How to join a plain loop's micro-batches into its large batch (see the module's
    docstring): ``pad`` as given, else as they are where no tensor needs padding, else the
    first padding by PyTorch's conventions that leaves every micro-batch's own loss as it
    is; ValueError in one line where none does."""
    if pad is not None:
        return lambda mbs: join_batches(mbs, pad)
    ragged = _ragged(batches)
    if not ragged:
        return lambda mbs: join_batches(mbs, {})
    first = batches[0]
    choices = []
    for key in ragged:
        tensor = first[key]
        named = str(key).lower()
        if tensor.is_floating_point() or tensor.dtype == torch.bool or named in _MASKS:
            choices.append([0])
        elif named in _LABELS:
            choices.append([-100, 0])
        elif any(named.startswith(k) for k in ("input", "ids", "x")):
            choices.append([0, -100])
        else:  # an unnamed integer tensor (a tuple's): labels or inputs, tried both ways
            choices.append([-100, 0] if key == len(first) - 1 else [0, -100])
    longest = _longest(batches, ragged)
    for values in itertools.islice(itertools.product(*choices), 16):
        fills = dict(zip(ragged, values, strict=True))
        if _neutral(model, loss, batches, fills, longest):
            return lambda mbs, fills=fills: join_batches(mbs, fills)
    lengths = sorted({int(b[ragged[0]].shape[1]) for b in batches})
    raise ValueError(
        f"the micro-batches have different lengths ({', '.join(map(str, lengths))} on dim 1 "
        f"of {ragged[0]!r}) and no padding the audit knows leaves each one's own loss as it "
        "is: give pad={key or position: value} (-100 for labels) or join=f(micro_batches) "
        "returning the large batch"
    )


def _fields(batch: Any) -> dict[Any, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return {0: batch}
    items = enumerate(batch) if isinstance(batch, (tuple, list)) else batch.items()
    return {k: v for k, v in items if isinstance(v, torch.Tensor)}


def _ragged(batches: list[Any]) -> list[Any]:
    """The keys (or positions) whose tensors differ in length on dim 1 across micro-batches."""
    fields = [_fields(b) for b in batches]
    out = []
    for key, tensor in fields[0].items():
        if tensor.dim() >= 2 and len({f[key].shape[1] for f in fields if key in f}) > 1:
            out.append(key)
    return out


def _longest(batches: list[Any], ragged: list[Any]) -> int:
    return max(int(_fields(b)[k].shape[1]) for b in batches for k in ragged)


def _neutral(model, loss, batches, fills, longest) -> bool:
    """Whether padding each micro-batch to ``longest`` with ``fills`` leaves its loss as it
    was (dropout off, no gradient): the padding is then invisible to the loss."""
    ragged = list(fills)
    with torch.no_grad(), _no_dropout(model):
        for batch in batches:
            if int(_fields(batch)[ragged[0]].shape[1]) == longest:
                continue
            padded = join_batches([batch, _stub(batch, ragged, longest)], fills)
            padded = _first_rows(padded, _rows(batch))
            try:
                a, b = loss(model, batch), loss(model, padded)
            except (IndexError, RuntimeError, ValueError):  # a pad value the model refuses
                return False
            if not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7):
                return False
    return True


def _rows(batch: Any) -> int:
    return int(next(iter(_fields(batch).values())).shape[0])


def _stub(batch: Any, ragged: list[Any], longest: int) -> Any:
    """A one-row micro-batch of ``batch``'s kind whose ragged tensors are ``longest`` long:
    joined after ``batch``, it pads ``batch`` to that length."""

    def one(key: Any, t: torch.Tensor) -> torch.Tensor:
        row = t[:1]
        if key in ragged:
            row = row.new_zeros((1, longest, *t.shape[2:]))
        return row

    if isinstance(batch, torch.Tensor):
        return one(0, batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(
            one(i, v) if isinstance(v, torch.Tensor) else v for i, v in enumerate(batch)
        )
    return {k: one(k, v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _first_rows(batch: Any, rows: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:rows]
    if isinstance(batch, (tuple, list)):
        return type(batch)(v[:rows] if isinstance(v, torch.Tensor) else v for v in batch)
    return {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _where(step: Callable[..., Any]) -> str:
    """Where the user's loop runs its backward and what to write there, as a diff of that
    line (``--- FILE`` / ``+++ FILE`` / ``@@ -LINE +LINE @@`` / ``-`` its line / ``+`` the
    line to write), after the fix's words; nothing where its source cannot be read."""
    try:
        lines, first = inspect.getsourcelines(step)
        file = inspect.getsourcefile(step)
    except (OSError, TypeError):
        return ""
    for offset, line in enumerate(lines):
        if ".backward(" in line:
            number, text = first + offset, line.rstrip("\n")
            indent = text[: len(text) - len(text.lstrip())]
            return (
                f"; your loop's backward, {file}:{number}:\n"
                f"--- {file}\n+++ {file}\n@@ -{number} +{number} @@\n"
                f"-{text}\n"
                f"+{indent}(loss_sum / window_items).backward()  # loss_sum: this micro-batch's "
                "loss with reduction='sum'; window_items: the items the whole window's loss "
                "counts (labels that are not -100), counted before its first backward"
            )
    return ""


def compare(case: AuditWindow, tolerance: float = TOLERANCE) -> AuditResult:
    """Run ``case``'s window and its large batch (dropout off, the weights restored after)
    and compare their gradients: the ``AuditResult``, with its cause and fix."""
    model = case.model
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    was_training = model.training
    try:
        with _no_dropout(model):
            _clear(params)
            model.train()
            case.run()
            got = _grads(params)
            _clear(params)
            case.big().backward()
            want = _grads(params)
            _clear(params)
            case.equal().backward()
            equal_weights = _grads(params)
            _clear(params)
            router = router_loss_setting(model)
            without_router = None
            if router is not None:  # the large batch as the model computes it without it
                with _no_router_loss(model):
                    case.big().backward()
                without_router = _grads(params)
                _clear(params)
    finally:
        model.train(was_training)
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(b)
    n = case.micro_batches() if callable(case.micro_batches) else case.micro_batches
    err = _rel(got, want)
    dot = sum(float((g.double() * w.double()).sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.double().square().sum()) for w in want)
    ratio = dot / norm if norm else float("nan")
    passed = err <= tolerance
    if passed:
        return AuditResult(err, ratio, passed, tolerance, n, None)
    # off the large batch's direction: |g - ratio g_big| / |ratio g_big| (0 for a multiple)
    off_line = _rel(got, [w * ratio for w in want])
    found = Found(
        ratio,
        n,
        off_line,
        _rel(got, equal_weights),
        None if without_router is None else _rel(got, without_router),
        dict(case.scaled()) if case.scaled is not None else {},
    )
    ragged = found.scaled.get("ragged_window")
    if ragged is not None and ragged != 1:  # divided by the configured N, not its length
        found = dataclasses.replace(
            found, off_ragged=_rel(got, [e * ragged for e in equal_weights])
        )
    kind, headline, why = _cause(model, found)
    fix = case.fixes.get(kind, FIXES[kind])
    return AuditResult(err, ratio, passed, tolerance, n, f"{headline}: {why}", fix, kind, headline)


@dataclass(frozen=True)
class Found:
    """What the comparison measured, for naming a cause: ``ratio`` and ``n`` as in the
    result; ``off_line``: how far the window's gradient is from the large batch's direction
    (relative, 0 when it is a multiple of it); ``off_equal``, ``off_router``: its relative
    distance from the equal-weights mean and from the large batch without the router loss;
    ``scaled``: the adapter's known factors (``ragged_window``: the window's micro-batches
    over the accumulation steps it was divided by, a factor on the equal-weights mean)."""

    ratio: float
    n: int
    off_line: float
    off_equal: float
    off_router: float | None
    scaled: dict[str, float]
    off_ragged: float | None = None  # from the equal-weights mean times the ragged factor


def _cause(model: nn.Module, f: Found) -> tuple[str, str, str]:
    """(the cause's name, the cause in a few words, why: what the gradient shows)."""
    ratio, n = f.ratio, f.n
    if n > 1 and abs(ratio - n) <= 0.1 * n:
        return (
            "mean_per_micro_batch",
            f"the gradient is {ratio:.2f}x the large batch's with {n} micro-batches",
            "the loss is a mean per micro-batch and nothing divides it by the accumulation "
            "steps (a compute_loss that ignores num_items_in_batch?)",
        )
    factor = f.scaled.get("labels_before_shift")
    if factor is not None and f.off_line <= 1e-4 and abs(ratio - factor) <= 1e-3 * factor:
        return (
            "labels_before_shift",
            "the trainer counted a causal LM's labels before the shift",
            f"the gradient is the large batch's times {ratio:.4f}: the labels the loss counts "
            "after its shift, over the labels the trainer divided by, which include every "
            "sequence's first label (no token predicts it)",
        )
    if f.off_ragged is not None and f.off_ragged <= 1e-4:
        factor = f.scaled["ragged_window"]
        return (
            "ragged_window",
            f"a ragged window: {n} micro-batches divided by the configured accumulation "
            f"steps, not by {n}",
            f"the gradient is {factor:.3g}x the micro-batches' means averaged, and each "
            "micro-batch's loss is its own mean, weighted equally whatever its item count",
        )
    if f.off_router is not None and f.off_router <= 1e-4:
        setting = router_loss_setting(model)[0]
        return (
            "router_loss",
            "the model's auxiliary loss is not in the trained loss",
            f"the window's gradient is the large batch's without the router loss ({setting})",
        )
    if f.off_equal <= 1e-4:
        return (
            "equal_weights",
            "micro-batches are weighted equally whatever their item counts",
            "each micro-batch's loss is its own mean, so one with few items (tokens, pairs) "
            "weighs as much as one with many",
        )
    norms = batchnorm_modules(model)
    if norms:
        return (
            "batchnorm",
            f"{len(norms)} BatchNorm layer(s) normalize with each micro-batch's own statistics",
            "the window's forward is then not the large batch's",
        )
    return (
        "unknown",
        "no known cause matched",
        f"not a mean per micro-batch left undivided ({ratio:.3g}x, not {n}x), not a multiple "
        f"of the large batch's gradient ({f.off_line:.1e} off its direction), not the "
        f"micro-batches' means weighted equally ({f.off_equal:.1e} off), no BatchNorm"
        + ("" if f.off_router is None else ", not the router loss left out"),
    )


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
