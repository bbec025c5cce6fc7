"""TrainConfig: the one source of defaults, help text and validation for
``gradaccum train`` (its fields' ``help`` are the CLI's --help), and what a resume may change."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from gradaccum.app.recipes import RECIPES
from gradaccum.app.targets import Targets, parse_seconds
from gradaccum.memory import parse_bytes
from gradaccum.pipeline import SCHEDULES
from gradaccum.plan import CHECKPOINTING
from gradaccum.precision import PRECISIONS
from gradaccum.schedule import LR_RULES, schedule_problems
from gradaccum.validate import int_problem

__all__ = ["RESUMABLE", "SHARDS", "RecipeDefault", "TrainConfig"]

SHARDS = ("ddp", "fsdp")


class RecipeDefault:
    """The default of an option a recipe may set otherwise (minilm trains an effective batch
    of 256, not 64). A configuration resolves it as it is made (``__post_init__``), so a run
    is the same whether it comes from the command line, a config file or Python."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:  # the --help line's "(default: ...)"
        return f"{self.value}, or the recipe's own"


@dataclass(kw_only=True)
class TrainConfig:
    recipe: str = field(
        default="gpt",
        metadata={
            "help": "built-in model and data: gpt (byte-level GPT on the Python stdlib's source), "
            "digits (GroupNorm CNN on scikit-learn's digits), minilm (fine-tune pretrained "
            "MiniLM on stdlib docstrings), segment (U-Net segmenting 256x256 procedural "
            "images; segment-batchnorm: the same with BatchNorm); minilm and segment set "
            "their own batch, budget and length",
            "choices": sorted(RECIPES),
        },
    )
    hf_model: str | None = field(
        default=None,
        metadata={
            "help": "a Hugging Face causal LM from a local directory or config JSON (no hub); "
            "replaces --recipe",
            "metavar": "PATH",
        },
    )
    data: str | None = field(
        default=None,
        metadata={
            "help": "train on your own text: a .txt file, a .jsonl file (a text field per line, "
            "or prompt/completion pairs) or a folder of them; with --recipe gpt (bytes) or "
            "--hf-model (its tokenizer)",
            "metavar": "PATH",
        },
    )
    text_field: str = field(
        default="text", metadata={"help": "the .jsonl field that holds each document's text"}
    )
    seq_len: int | None = field(
        default=None,
        metadata={
            "help": "tokens per sequence for --data (default: the model's own length, at most "
            "128); documents are packed, prompt/completion pairs padded"
        },
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={"help": "share of --data's sequences held out for evaluation (seeded)"},
    )
    lora: int | None = field(
        default=None,
        metadata={
            "help": "train LoRA adapters of this rank on the frozen --hf-model (PEFT; "
            "pip install 'gradaccum[finetune]')",
            "metavar": "R",
        },
    )
    lora_alpha: float | None = field(
        default=None, metadata={"help": "LoRA scaling alpha (default: 2 x --lora)"}
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    lora_targets: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated layer names to adapt (default: the attention projections "
            "of common causal LMs, e.g. q_proj,v_proj or GPT-2's c_attn)",
            "metavar": "NAMES",
        },
    )
    export_every: int | None = field(
        default=None,
        metadata={
            "help": "also export the weights every N steps (they are always exported at the "
            "end): the LoRA adapter, or the fine-tuned --hf-model, in Hugging Face format"
        },
    )
    merge_lora: bool = field(
        default=False,
        metadata={"help": "with --lora, also export the base with the adapters merged in"},
    )
    effective_batch: int = field(
        default=RecipeDefault(64),
        metadata={"help": "samples per optimizer step (sequences for the LMs, images for digits)"},
    )
    batch_schedule: str = field(
        default="constant",
        metadata={
            "help": "how the effective batch changes, in whole micro-batches: constant; "
            "steps:S=B,... (B samples from step S on); samples:N=B,... (from N samples seen "
            "on); linear:N=B (a ramp from --effective-batch to B over N samples); auto "
            "(raised toward the measured critical batch, within --max-effective-batch)",
            "metavar": "SCHEDULE",
        },
    )
    max_effective_batch: int | None = field(
        default=None,
        metadata={"help": "auto's ceiling (default: 8 x --effective-batch)"},
    )
    lr_scaling: str = field(
        default="sqrt",
        metadata={
            "help": "how --lr follows a scheduled batch: sqrt (x sqrt(B / B0), the rule for "
            "Adam), linear (x B / B0, the rule for SGD) or none; --lr is the rate at "
            "--effective-batch",
            "choices": list(LR_RULES),
        },
    )
    micro_batch: int | None = field(
        default=None,
        metadata={"help": "samples per micro-batch; planned from --budget when not given"},
    )
    budget: str = field(
        default=RecipeDefault("512MB"),
        metadata={"help": "memory budget for planning the micro-batch: bytes or 2GiB, 1500MB, ..."},
    )
    checkpointing: str = field(
        default="off",
        metadata={
            "help": "activation checkpointing of the model's repeated blocks: off, on, or auto "
            "(only when the plan finds nothing fits without)",
            "choices": list(CHECKPOINTING),
        },
    )
    pipeline_stages: int = field(
        default=1,
        metadata={
            "help": "cut the model into this many pipeline stages, one per process (under "
            "torchrun --nproc-per-node S; --recipe gpt): each window's micro-batches stream "
            "through the stages, exactly",
            "metavar": "S",
        },
    )
    pipeline_schedule: str = field(
        default="1f1b",
        metadata={
            "help": "the pipeline's schedule: 1f1b (holds at most S micro-batches' "
            "activations) or gpipe (all of them)",
            "choices": list(SCHEDULES),
        },
    )
    shard: str = field(
        default="ddp",
        metadata={
            "help": "how torchrun's processes hold the model: ddp (each a whole copy) or fsdp "
            "(FSDP2: each holds 1/N of the parameters, gradients and optimizer state; "
            "checkpoints through torch.distributed.checkpoint, and model.pt, the whole "
            "model, at the end)",
            "choices": list(SHARDS),
        },
    )
    lr: float = field(default=RecipeDefault(3e-3), metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(
        default=RecipeDefault(10),
        metadata={"help": "linear warm-up steps, then cosine decay to 10% of --lr"},
    )
    steps: int | None = field(
        default=RecipeDefault(150), metadata={"help": "optimizer steps to train"}
    )
    epochs: float | None = field(
        default=None, metadata={"help": "train this many passes over the data instead of --steps"}
    )
    samples: int | None = field(
        default=None,
        metadata={"help": "train on this many samples instead of --steps (e.g. with a schedule)"},
    )
    precision: str = field(
        default="fp32",
        metadata={
            "help": "fp32, bf16 (autocast) or fp16 (autocast + GradScaler)",
            "choices": list(PRECISIONS),
        },
    )
    max_grad_norm: float | None = field(
        default=1.0,
        metadata={"help": "clip the window's gradient to this global norm (0 turns clipping off)"},
    )
    seed: int = field(default=0, metadata={"help": "seed for initialization and data order"})
    noise_scale: bool = field(
        default=True,
        metadata={
            "help": "estimate the gradient noise scale (the critical batch) from each window; "
            "--no-noise-scale turns it off"
        },
    )
    eval_every: int = field(
        default=RecipeDefault(50), metadata={"help": "held-out evaluation every N steps"}
    )
    checkpoint_every: int = field(
        default=RecipeDefault(50), metadata={"help": "checkpoint every N steps"}
    )
    keep_checkpoints: int = field(
        default=2,
        metadata={
            "help": "with the guard, keep the last K checkpoints under checkpoints/ (hard "
            "links: no extra space while they are also checkpoint.pt)",
            "metavar": "K",
        },
    )
    guard: bool = field(
        default=True,
        metadata={
            "help": "the incident guard: a window whose loss (without clipping: or gradient "
            "norm) is far above the recent ones, or a run of skipped windows, rolls the run "
            "back to its last "
            "checkpoint and skips those windows' samples (incidents.jsonl); --no-guard "
            "turns it off"
        },
    )
    target_loss: float | None = field(
        default=None,
        metadata={
            "help": "stop when the held-out loss reaches this (checked at each evaluation: "
            "--eval-every)",
            "metavar": "LOSS",
        },
    )
    target_accuracy: float | None = field(
        default=None,
        metadata={
            "help": "stop when the held-out accuracy reaches this, in (0, 1] (recipes that "
            "measure accuracy: digits)",
            "metavar": "ACC",
        },
    )
    max_time: str | None = field(
        default=None,
        metadata={
            "help": "stop after this much training time over all sessions of the run: "
            "seconds, or 90s, 15m, 2h",
            "metavar": "TIME",
        },
    )
    max_memory: str | None = field(
        default=None,
        metadata={
            "help": "stop if the peak training memory reaches this: bytes or 2GiB, 1500MB, ...",
            "metavar": "BYTES",
        },
    )
    tensorboard: bool = field(
        default=True,
        metadata={
            "help": "write TensorBoard event files under RUN/tensorboard when the tensorboard "
            "package is installed; --no-tensorboard turns them off"
        },
    )
    out: str | None = field(
        default=None, metadata={"help": "run folder (default: runs/RECIPE-TIME)", "metavar": "DIR"}
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "continue the run in this folder exactly where its checkpoint stopped; flags "
            "given with it override its saved config (e.g. a larger --steps)",
            "metavar": "DIR",
        },
    )
    config: str | None = field(
        default=None,
        metadata={
            "help": "read options from a TOML or YAML file; flags override it",
            "metavar": "FILE",
        },
    )

    def __post_init__(self) -> None:
        # The recipe's own defaults, where it has them (not for --hf-model, which replaces
        # the recipe), then TrainConfig's: the one place a default is resolved.
        own = {}
        if self.hf_model is None and self.recipe in RECIPES:
            own = RECIPES[self.recipe].defaults
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, RecipeDefault):
                setattr(self, f.name, own.get(f.name, value.value))

    def problems(self) -> list[str]:
        """Every problem with this configuration, so a user fixes them in one pass."""
        out: list[str] = []

        def positive_int(name: str, optional: bool = False, minimum: int = 1) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if (problem := int_problem(value, name, minimum)) is not None:
                out.append(problem)

        positive_int("effective_batch")
        positive_int("seq_len", optional=True, minimum=2)
        if (
            isinstance(self.eval_fraction, bool)
            or not isinstance(self.eval_fraction, (int, float))
            or not 0 <= self.eval_fraction < 1
        ):
            out.append(f"eval_fraction must be a number in [0, 1), got {self.eval_fraction!r}")
        positive_int("lora", optional=True)
        positive_int("export_every", optional=True)
        if self.lora is not None and self.hf_model is None:
            out.append("lora needs --hf-model PATH: PEFT adapts Hugging Face models")
        if self.merge_lora and self.lora is None:
            out.append("merge_lora needs --lora R")
        if self.data is None and self.seq_len is not None:
            out.append("seq_len applies to --data only; give --data PATH too")
        positive_int("micro_batch", optional=True)
        positive_int("steps", optional=True)
        positive_int("samples", optional=True)
        if self.samples is not None and self.epochs is not None:
            out.append("give --samples or --epochs, not both")
        out.extend(
            schedule_problems(
                self.batch_schedule,
                self.effective_batch if int_problem(self.effective_batch, "") is None else 1,
                1,
                self.max_effective_batch,
            )
        )
        if self.batch_schedule == "auto" and not self.noise_scale:
            out.append("batch_schedule auto needs the noise scale: drop --no-noise-scale")
        if self.max_effective_batch is not None and self.batch_schedule != "auto":
            out.append("max_effective_batch applies to --batch-schedule auto only")
        if self.lr_scaling not in LR_RULES:
            out.append(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}")
        positive_int("eval_every")
        positive_int("checkpoint_every")
        positive_int("keep_checkpoints")
        out.extend(self._target_problems())
        positive_int("warmup_steps", minimum=0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            out.append(f"seed must be an integer, got {self.seed!r}")
        if (
            isinstance(self.micro_batch, int)
            and isinstance(self.effective_batch, int)
            and self.micro_batch > self.effective_batch
        ):
            out.append(
                f"micro_batch {self.micro_batch} is larger than effective_batch "
                f"{self.effective_batch}"
            )
        if self.micro_batch is None:
            try:
                parse_bytes(self.budget)
            except (ValueError, TypeError) as err:
                out.append(f"budget: {err}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and (value > 0 if name == "lr" else value >= 0))
            ):
                out.append(
                    f"{name} must be a {'positive' if name == 'lr' else 'non-negative'} "
                    f"number, got {value!r}"
                )
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, (int, float))
            or self.max_grad_norm < 0
        ):
            out.append(f"max_grad_norm must be a number >= 0, got {self.max_grad_norm!r}")
        if self.epochs is not None:
            if (
                isinstance(self.epochs, bool)
                or not isinstance(self.epochs, (int, float))
                or not (math.isfinite(self.epochs) and self.epochs > 0)
            ):
                out.append(f"epochs must be a positive finite number, got {self.epochs!r}")
        if self.checkpointing not in CHECKPOINTING:
            allowed = ", ".join(CHECKPOINTING)
            out.append(f"checkpointing must be one of {allowed}, got {self.checkpointing!r}")
        if self.precision not in PRECISIONS:
            out.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.hf_model is None and self.recipe not in RECIPES:
            out.append(f"recipe must be one of {', '.join(sorted(RECIPES))}, got {self.recipe!r}")
        out.extend(self._pipeline_problems())
        out.extend(self._shard_problems())
        return out

    def _shard_problems(self) -> list[str]:
        if self.shard not in SHARDS:
            return [f"shard must be one of {', '.join(SHARDS)}, got {self.shard!r}"]
        if self.shard == "ddp":
            return []
        out = []
        if self.pipeline_stages != 1:
            out.append("shard fsdp with pipeline_stages: one or the other (2D is not built)")
        if self.lora is not None:
            out.append(
                "shard fsdp with lora: the adapters are a few megabytes, nothing to shard; "
                "use --shard ddp"
            )
        if self.precision == "fp16":
            out.append(
                "shard fsdp with precision fp16: each rank would see only its own shards' "
                "overflow; use --precision bf16"
            )
        return out

    def _pipeline_problems(self) -> list[str]:
        if self.pipeline_schedule not in SCHEDULES:
            allowed = ", ".join(SCHEDULES)
            return [f"pipeline_schedule must be one of {allowed}, got {self.pipeline_schedule!r}"]
        if (problem := int_problem(self.pipeline_stages, "pipeline_stages")) is not None:
            return [problem]
        if self.pipeline_stages == 1:
            return []
        from gradaccum.app.recipes import GPT_SHAPE

        out = []
        # What a pipeline run does not do yet, each with what to use instead.
        if self.hf_model is not None or self.recipe != "gpt":
            out.append("pipeline_stages splits the built-in GPT only: use --recipe gpt")
        elif self.pipeline_stages > GPT_SHAPE["n_layers"]:
            out.append(
                f"pipeline_stages {self.pipeline_stages}: the GPT has "
                f"{GPT_SHAPE['n_layers']} blocks, so at most {GPT_SHAPE['n_layers']} stages"
            )
        if self.data is not None:
            out.append(
                "pipeline_stages with --data: a pipeline runs micro-batches of one shape, and "
                "your data's last window of an epoch is shorter; train it without a pipeline"
            )
        if self.batch_schedule != "constant":
            out.append(
                "pipeline_stages needs a constant batch (the schedule runs one micro-batch "
                f"shape), not batch_schedule {self.batch_schedule}"
            )
        if self.checkpointing != "off":
            out.append("pipeline_stages runs without activation checkpointing: --checkpointing off")
        if (
            isinstance(self.micro_batch, int)
            and isinstance(self.effective_batch, int)
            and self.micro_batch <= self.effective_batch
            and self.effective_batch % self.micro_batch
        ):
            out.append(
                f"pipeline_stages needs equal micro-batches: micro_batch {self.micro_batch} "
                f"does not divide effective_batch {self.effective_batch}"
            )
        return out

    def _target_problems(self) -> list[str]:
        out = []
        for name, low, high in (("target_loss", None, None), ("target_accuracy", 0, 1)):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or (low is not None and not low < value <= high)
            ):
                what = "a number in (0, 1]" if low is not None else "a finite number"
                out.append(f"{name} must be {what}, got {value!r}")
        if self.target_accuracy is not None:
            recipe = RECIPES.get(self.recipe)
            if self.hf_model or self.data or recipe is None or "accuracy" not in recipe.metrics:
                measured = [n for n, r in sorted(RECIPES.items()) if "accuracy" in r.metrics]
                out.append(
                    "target_accuracy needs a recipe whose evaluation measures accuracy "
                    f"({', '.join(measured)}); this run measures held-out loss: use --target-loss"
                )
        if self.max_time is not None:
            try:
                parse_seconds(self.max_time)
            except ValueError as err:
                out.append(f"max_time: {err}")
        if self.max_memory is not None:
            try:
                parse_bytes(self.max_memory)
            except (ValueError, TypeError) as err:
                out.append(f"max_memory: {err}")
        return out

    def targets(self) -> Targets:
        return Targets(
            target_loss=self.target_loss,
            target_accuracy=self.target_accuracy,
            max_time=None if self.max_time is None else parse_seconds(self.max_time),
            max_memory=None if self.max_memory is None else parse_bytes(self.max_memory),
        )


# What a resumed run may change: how long it trains and how it reports. Everything else
# defines the run and must stay as it was (a different run belongs in its own folder).
RESUMABLE = (
    "steps",
    "epochs",
    "samples",
    "eval_every",
    "checkpoint_every",
    "noise_scale",
    "export_every",
    "merge_lora",
    "keep_checkpoints",
    "target_loss",
    "target_accuracy",
    "max_time",
    "max_memory",
    "tensorboard",
    "guard",  # the way to train on past a run the guard stopped
)
