"""TRL's trainers as the Hugging Face mixin (``integrations/transformers.py``) runs them
exactly: ``DPOTrainer``, whose items are preference pairs (its per-pair losses only), and
``GRPOTrainer``, whose loss the mixin normalizes over the whole window by its
``loss_type``. Each found by its class's name and module, never by importing TRL; what the
mixin cannot compute as TRL would is said (``preference_problems``, ``rl_problems``)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "RL_NORMALIZATIONS",
    "is_preference_trainer",
    "is_rl_trainer",
    "preference_pairs",
    "preference_problems",
    "rl_problems",
]

# TRL's DPOTrainer: losses that are one value per preference pair, with no state between
# micro-batches ("bco_pair" keeps a running mean of rewards, "aot" sorts across the batch,
# "sft" is a mean over tokens)
_PER_PAIR_LOSSES = frozenset(
    {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "sppo_hard", "apo_zero"}
    | {"apo_down", "discopop", "sigmoid_norm"}
)


def is_preference_trainer(trainer: Any) -> bool:
    """TRL's DPOTrainer (or a subclass of it), found without importing TRL."""
    return any(
        c.__name__ == "DPOTrainer" and c.__module__.startswith("trl.")
        for c in type(trainer).__mro__
    )


def preference_pairs(inputs: dict[str, Any]) -> int:
    """The preference pairs of a TRL DPOTrainer micro-batch: its rows are the chosen
    completions, then the rejected ones."""
    return len(inputs["input_ids"]) // 2


def preference_problems(trainer: Any) -> list[str]:
    """Why a DPOTrainer's own loss is not a mean over its pairs, if it is not."""
    problems = []
    other = [t for t in getattr(trainer, "loss_types", []) if t not in _PER_PAIR_LOSSES]
    if other:
        problems.append(
            f"DPO loss_type {', '.join(other)} is not one value per preference pair (a "
            "mean over tokens, a running mean or a sort across the batch), so no sum over "
            "pairs gives the large batch's; use "
            + ", ".join(sorted(_PER_PAIR_LOSSES))
            + ", or loss_fn=(model, inputs) -> (loss_sum, count)"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append(
            "the router's auxiliary loss (use_router_aux_loss / output_router_logits) is added "
            "once per micro-batch, not per pair; give loss_fn= with it as a named term"
        )
    return problems


def is_rl_trainer(trainer: Any) -> bool:
    """TRL's GRPOTrainer (or a subclass of it), found without importing TRL."""
    return any(
        c.__name__ == "GRPOTrainer" and c.__module__.startswith("trl.")
        for c in type(trainer).__mro__
    )


RL_NORMALIZATIONS = {"dapo": "per_token", "bnpo": "per_token", "grpo": "per_sequence"}
RL_NORMALIZATIONS["dr_grpo"] = "constant_normalizer"


def rl_problems(trainer: Any) -> list[str]:
    """What the mixin's GRPO loss does not compute as TRL's GRPOTrainer would."""
    args, problems = trainer.args, []
    if trainer.loss_type not in RL_NORMALIZATIONS:
        problems.append(
            f"GRPO loss_type {trainer.loss_type!r}: the mixin computes "
            + ", ".join(sorted(RL_NORMALIZATIONS))
            + "; give loss_fn=(model, inputs) -> (loss_sum, count) for others"
        )
    settings = {
        "importance_sampling_level='sequence'": trainer.importance_sampling_level != "token",
        "delta (two-sided clipping)": getattr(args, "delta", None) is not None,
        "off_policy_mask_threshold": getattr(trainer, "off_policy_mask_threshold", None)
        is not None,
        "top_entropy_quantile < 1": getattr(trainer, "top_entropy_quantile", 1.0) < 1.0,
        "use_vllm (its importance-sampling correction)": getattr(trainer, "use_vllm", False),
        "the router's auxiliary loss": getattr(trainer, "aux_loss_enabled", False),
        "use_bias_correction_kl": trainer.beta != 0.0
        and getattr(args, "use_bias_correction_kl", False),
    }
    unsupported = [name for name, on in settings.items() if on]
    if unsupported:
        problems.append(
            "the mixin's GRPO loss is the clipped surrogate with its KL term; not with "
            + ", ".join(unsupported)
            + " (give loss_fn= for them)"
        )
    if trainer.oom is not None or trainer.schedule is not None:
        problems.append(
            "oom= and schedule= re-run or re-size a window's micro-batches, and GRPOTrainer "
            "generates and buffers completions per window; give neither"
        )
    return problems
