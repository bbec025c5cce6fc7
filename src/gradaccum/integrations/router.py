"""A Hugging Face mixture-of-experts model's router load-balancing loss, as the integrations
count it over a window: whether a model adds one (``router_loss_setting``, read off its
modules' attributes and config), the window term that makes it exact (``router_term``,
``RouterTerm``), its coefficient and the inputs of the routing pass before the window.
Hugging Face's model knowledge (its config fields, its causal-LM classes, the classes whose
``aux_loss`` is transformers' ``load_balancing_loss_func``) lives here, not in the library's
loss.py, which keeps the arithmetic (``load_balancing``, ``routing_counts``). transformers
is imported only where a model's class is checked against its causal-LM classes."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from gradaccum.loss import load_balancing, routing_counts

__all__ = [
    "RouterTerm",
    "is_causal_lm",
    "router_coefficient",
    "router_inputs",
    "router_loss_setting",
    "router_term",
]

# Causal LMs whose forward adds coefficient x load_balancing_loss_func(outputs.router_logits,
# self.num_experts, self.num_experts_per_tok, attention_mask) to their loss (read in
# transformers' sources); each micro-batch's aux_loss is checked against that form as it runs.
_LOAD_BALANCED = frozenset(
    f"{name}ForCausalLM"
    for name in (
        "Dbrx DeepseekV4 Ernie4_5_Moe FlexOlmo Flint GptOss GraniteMoe GraniteMoeSWA "
        "GraniteMoeHybrid GraniteMoeShared Jamba JetMoe Laguna LaraMini Mellum MiniMax MiniMaxM2 "
        "MiniMaxM3VL Mixtral Olmoe Phimoe Qwen2Moe Qwen3_5Moe Qwen3Moe Qwen3Next Qwen4Exp"
    ).split()
)


def is_causal_lm(base: torch.nn.Module) -> bool:
    """A decoder-only causal LM of transformers' (whose loss the mixin computes itself)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(base, "config", None)
    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return type(base).__name__ in names and not getattr(config, "is_encoder_decoder", False)


def _counts(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def _random_settings(model: torch.nn.Module) -> list[str]:
    """What makes a model's training forward random: its config's dropout and jitter
    settings above 0 (``attention_dropout``, ``router_jitter_noise``) and dropout modules."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found: dict[str, str] = {}
    for c in (config, text):
        for key, value in (c.to_dict() if hasattr(c, "to_dict") else {}).items():
            if (
                ("dropout" in key or "jitter" in key)
                and isinstance(value, numbers.Real)
                and not isinstance(value, bool)
                and value > 0
            ):
                found[key] = f"{key}={value:g}"
    drops = sum(isinstance(m, _DROPOUTS) and m.p > 0 for m in model.modules())
    if drops:
        found[""] = f"{drops} dropout module(s) with p > 0"
    return list(found.values())


def router_term(base: torch.nn.Module, setting: str) -> tuple[RouterTerm | None, str | None]:
    """``base``'s router loss (turned on by ``setting``) as a window term, or why it cannot
    be one, ending with what to do on the model's side (an integration adds its own): a class whose
    ``aux_loss`` is not transformers' load-balancing form, or a forward that draws random
    numbers in training (a routing pass would route differently)."""
    name = type(base).__name__
    experts = getattr(base, "num_experts", None)
    top_k = getattr(base, "num_experts_per_tok", None)
    if name not in _LOAD_BALANCED or not is_causal_lm(base) or not _counts(experts, top_k):
        return None, (
            f"{name} adds an auxiliary loss to its own ({setting}) that gradaccum does not "
            "know how to count over a window; set output_router_logits=False"
        )
    random = _random_settings(base)
    if random:
        return None, (
            f"{name}'s router loss ({setting}) needs the window's routing from a pass "
            f"besides training, and its forward draws random numbers in training "
            f"({', '.join(random)}), so the pass would route differently; set them to 0, "
            "or output_router_logits=False"
        )
    return RouterTerm(name, experts, top_k), None


def router_coefficient(base: torch.nn.Module, *owners: Any) -> float | None:
    """The router loss's coefficient: the first ``owners``' (TRL's trainers keep their own),
    else the model's (its forward's), else its config's."""
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for owner in (*owners, base, text):
        for attribute in ("router_aux_loss_coef", "aux_loss_coef"):
            value = getattr(owner, attribute, None)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                return float(value)
    return None


def router_inputs(base: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A micro-batch's inputs for a routing pass: no labels (no token loss), the router's
    logits on, and only the last position's vocabulary logits where the model can skip
    the rest (the pass needs the router's logits alone)."""
    rest = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
    rest["output_router_logits"] = True
    if "logits_to_keep" in inspect.signature(base.forward).parameters:
        rest["logits_to_keep"] = 1
    return rest


class RouterTerm:
    """A causal LM's router load-balancing loss (its coefficient x transformers'
    ``load_balancing_loss_func`` over the batch's routed tokens) as its own term of the
    window: each micro-batch's sum over its routed rows weighted by the whole window's share
    of assignments per expert (``gradaccum.loss.load_balancing``), counted by its routed
    rows, weighted by the coefficient. The window's term is then the whole window's loss,
    and its gradient the whole window's.

    The shares come from a pass without gradient over the window before its first backward
    (``begin``). As the micro-batches train, their routing is added up, and the model's own
    ``aux_loss`` on each is compared with that form over the same logits; ``check`` reads
    both once, before the window's end, and refuses a window that is not exact."""

    def __init__(self, model: str, experts: int, top_k: int) -> None:
        self.model, self.experts, self.top_k = model, experts, top_k
        self.coefficient = 0.0
        self.fraction = torch.zeros(experts)
        self.expected = torch.zeros(experts)  # this rank's assignments, from the pass
        self.seen = torch.zeros(experts)  # this rank's assignments, as it trains
        self.deviation = torch.zeros(())  # the model's aux_loss against the form, relative

    def logits(self, outputs: Any) -> Any:
        logits = outputs.get("router_logits") if isinstance(outputs, dict) else None
        if not logits or outputs.get("aux_loss") is None:
            raise ValueError(
                f"{self.model} returned no router_logits or aux_loss with "
                "output_router_logits=True, so its router loss cannot be counted; set "
                "output_router_logits=False, or give loss_fn= returning it as a named term"
            )
        return logits

    def begin(self, assigned: torch.Tensor, rows: Any, sync: Any, coefficient: float) -> None:
        """The window's shares: this rank's assignments and rows, summed over the ranks."""
        *total, total_rows = sync.sum([*assigned.tolist(), float(rows)])
        shares = torch.tensor(total, dtype=torch.float64) / max(total_rows, 1.0)
        self.fraction = shares.to(device=assigned.device, dtype=torch.float32)
        self.expected, self.coefficient = assigned, coefficient
        self.restart()

    def restart(self) -> None:
        """The window's micro-batches run again (an out-of-memory replay)."""
        self.seen = torch.zeros_like(self.expected)
        self.deviation = torch.zeros((), device=self.expected.device)

    def term(self, outputs: Any, mask: torch.Tensor | None) -> tuple[torch.Tensor, Any, float]:
        """One micro-batch's ``(loss_sum, routed rows, coefficient)``."""
        logits = self.logits(outputs)
        aux_sum, rows = load_balancing(logits, self.experts, self.fraction, mask)
        assigned, _ = routing_counts(logits, self.experts, self.top_k, mask)
        self.seen += assigned
        with torch.no_grad():  # the model's aux_loss on this micro-batch alone, in this form
            n = rows.clamp(min=1.0)
            own = load_balancing(logits, self.experts, assigned / n, mask)[0] / n
            theirs = outputs["aux_loss"].detach().float().to(own.device)
            off = (own - theirs).abs() / theirs.abs().clamp(min=1e-12)
            self.deviation = torch.maximum(self.deviation, torch.where(rows > 0, off, 0.0))
        return aux_sum, rows, self.coefficient

    def check(self) -> None:
        """The window's routing as the pass counted it, and the model's aux_loss of the
        form trained (one read from the device per window)."""
        if not torch.equal(self.seen, self.expected):
            raise ValueError(
                f"{self.model} routed the window's tokens differently in training than in the "
                f"pass before it (assignments per expert {self.seen.tolist()} against "
                f"{self.expected.tolist()}): its forward is not deterministic here, so its "
                "router loss cannot be counted exactly; set output_router_logits=False, or give "
                "loss_fn= returning it as a named term"
            )
        deviation = float(self.deviation)
        if not deviation <= 1e-4:
            raise ValueError(
                f"{self.model}'s aux_loss differs from transformers' load_balancing_loss_func "
                f"over its router_logits by {deviation:.1e} (relative), so gradaccum cannot "
                "count it over the window; set output_router_logits=False, or give loss_fn= "
                "returning it as a named term"
            )


def router_loss_setting(module: Any) -> tuple[str, float | None] | None:
    """Whether ``module`` (or a module inside it) is a Hugging Face mixture-of-experts model
    whose forward adds a router auxiliary loss to its own: ``(what turns it on, as
    "output_router_logits=True, router_aux_loss_coef=0.07", the coefficient or None when
    the model names none)``; None when none is added (``output_router_logits`` off, or a
    coefficient of 0). Read off the modules' attributes: the library imports no framework."""
    for m in module.modules() if hasattr(module, "modules") else [module]:
        config = getattr(m, "config", None)
        if config is None:
            continue
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not any(getattr(c, "output_router_logits", False) is True for c in (config, text)):
            continue
        for owner, name in (
            (m, "router_aux_loss_coef"),
            (m, "aux_loss_coef"),
            (text, "router_aux_loss_coef"),
            (text, "aux_loss_coef"),
        ):
            coef = getattr(owner, name, None)
            if isinstance(coef, numbers.Real) and not isinstance(coef, bool):
                if coef == 0:
                    break
                return f"output_router_logits=True, {name}={coef:g}", float(coef)
        else:
            return "output_router_logits=True", None
    return None
