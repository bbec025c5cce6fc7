"""The command's configuration: keyword-only sections of options, each option declared once.

An option (``Opt``) is its default, its help line (the CLI's --help), its check and whether a
resumed run may change it. ``TrainConfig`` groups train's options in sections (source, model,
batch, memory, numerics, schedule, incidents, targets, output, distributed); ``gradaccum plan``
and ``gradaccum check`` declare their fields from the same options, so one flag means one
thing, with one default, in every command.

Every option's name is unique across the sections: it is the flag (``effective_batch`` is
``--effective-batch``), the key in a config file (flat, or under its section's table) and in
a run folder's config.json (flat, as gradaccum 0.5 wrote it, so old runs resume). A recipe's
own defaults (minilm trains 256 samples per step) are resolved as a configuration is made,
so the CLI, a config file and Python train the same run. ``problems()`` reports every
problem, of type or of value, in one list.

``resolve_train`` is train's one resolver: the defaults, a resumed run's saved config, a
config file (``read_config_file``: TOML or YAML, its spellings coerced) and the flags, with
every problem of all of them in one error; cli/train.py only parses the flags and calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from gradaccum.app.folder import CONFIG, RunFolder
from gradaccum.app.recipes import GPT_SHAPE, RECIPES
from gradaccum.app.targets import Targets, parse_seconds
from gradaccum.memory import METERS, parse_bytes
from gradaccum.pipeline import SCHEDULES
from gradaccum.planning import CHECKPOINTING, FRAMEWORKS, PREFER
from gradaccum.planning.estimate.devices import GPUS
from gradaccum.precision import PRECISIONS
from gradaccum.schedule import LR_RULES, schedule_problems

__all__ = [
    "RESUMABLE",
    "SECTIONS",
    "SHARDS",
    "Batch",
    "CheckConfig",
    "HINTS",
    "OPTION_SECTION",
    "Distributed",
    "Incidents",
    "Memory",
    "Model",
    "Numerics",
    "Opt",
    "Output",
    "PlanConfig",
    "RecipeDefault",
    "Schedule",
    "Source",
    "TargetsConfig",
    "TrainConfig",
    "base_type",
    "invalid_configuration",
    "parse_config_file",
    "read_config_file",
    "resolve_train",
    "type_problem",
]

SHARDS = ("ddp", "fsdp")


def invalid_configuration(problems: list[str]) -> str:
    """Every problem with the command's configuration in one message: one line for one, a
    list for several; options named as their flags (``budget: 200 has no unit`` is said
    ``--budget: 200 has no unit``), as a config file's keys are the same names."""
    problems = [_flagged(p) for p in problems]
    if len(problems) == 1:
        return f"invalid configuration: {problems[0]}"
    return "invalid configuration:\n  - " + "\n  - ".join(problems)


def _flagged(problem: str) -> str:
    """A problem with its options named as flags: a name with an underscore wherever it
    stands (``micro_batch 100 is larger than effective_batch 64``), a one-word name where
    it opens the problem (``lr must be ...``; elsewhere a word like "steps" is English). A
    config file's own problems (``--config PATH: ...``) keep its keys as the file writes them."""
    if problem.startswith("--config "):
        return problem
    names = _option_names()

    def flag(match: re.Match) -> str:
        word = match.group(0)
        return "--" + word.replace("_", "-") if word in names else word

    problem = re.sub(r"(?<![-\w])[a-z]+(?:_[a-z0-9]+)+\b", flag, problem)
    return re.sub(r"^[a-z]+\b", flag, problem)


@functools.cache
def _option_names() -> frozenset[str]:
    """Every option of every command (train's sections, plan's, check's, targets')."""
    classes = [*SECTIONS.values(), PlanConfig, CheckConfig, TargetsConfig]
    return frozenset(f.name for cls in classes for f in fields(cls))


class RecipeDefault:
    """The default of an option a recipe may set otherwise (minilm trains an effective batch
    of 256, not 64), resolved as a configuration is made."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:  # the --help line's "(default: ...)"
        return f"{self.value}, or the recipe's own"


Check = Callable[[Any], "str | None"]  # a value of the right type -> what is wrong, or None


class Opt:
    """One option, declared once: calling it makes the dataclass field of any configuration
    that has it (a field object belongs to one class, so each gets its own)."""

    def __init__(
        self,
        default: Any,
        help: str,
        *,
        check: Check | None = None,
        choices: typing.Iterable[str] | None = None,
        metavar: str | None = None,
        resumable: bool = False,
    ) -> None:
        self.default, self.help, self.check = default, help, check
        self.choices = list(choices) if choices is not None else None
        self.metavar, self.resumable = metavar, resumable

    def __call__(self, *, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
        return field(
            default=self.default if default is dataclasses.MISSING else default,
            metadata={"opt": self, "help": self.help if help is None else help},
        )


# ----- checks: each takes a value already of the option's type ---------------------------


def at_least(minimum: int) -> Check:
    def check(value: int) -> str | None:
        return None if value >= minimum else f"must be an integer >= {minimum}"

    return check


def _lora_spec(value: str) -> str | None:
    """A rank (an integer >= 1), or a PEFT adapter_config.json or a folder holding one."""
    if value.isdigit():
        return None if int(value) >= 1 else "must be a rank >= 1 or an adapter_config.json"
    path = Path(value)
    if path.is_dir():
        path = path / "adapter_config.json"
    if path.is_file():
        return None
    return (
        f"must be a rank (an integer >= 1) or a PEFT adapter_config.json or a folder "
        f"holding one; {path} does not exist"
    )


def _deepspeed_spec(value: str) -> str | None:
    """A DeepSpeed configuration file: a JSON object (what a run passes as --deepspeed)."""
    path = Path(value)
    if not path.is_file():
        return f"must be a DeepSpeed configuration file (JSON); {path} does not exist"
    try:
        parsed = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"must be a DeepSpeed configuration file (JSON); {path}: {err}"
    return None if isinstance(parsed, dict) else f"{path} holds no JSON object"


def _positive(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a positive finite number"


def _non_negative(value: float) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite number >= 0"


def _finite(value: float) -> str | None:
    return None if math.isfinite(value) else "must be a finite number"


def _fraction(value: float) -> str | None:  # [0, 1)
    return None if 0 <= value < 1 else "must be a number in [0, 1)"


def _accuracy(value: float) -> str | None:  # (0, 1]
    return None if 0 < value <= 1 else "must be a number in (0, 1]"


# A number alone is bytes; below a megabyte nothing trains, so it is a unit left out
_UNITLESS_BELOW = 10**6


def _bytes(value: str) -> str | None:
    try:
        size = parse_bytes(value)
    except (ValueError, TypeError) as err:
        return str(err)
    text = str(value).strip()
    if size < _UNITLESS_BELOW and text.replace(".", "", 1).isdigit():
        return f"{text} has no unit, so it is {size} bytes; did you mean {text}MB?"
    return None


def _seconds(value: str) -> str | None:
    try:
        parse_seconds(value)
    except ValueError as err:
        return str(err)
    return None


def _recipe(value: str) -> str | None:
    return None if value in RECIPES else f"must be one of {', '.join(sorted(RECIPES))}"


# ----- the options ---------------------------------------------------------------------

RECIPE = Opt(
    "gpt",
    "built-in model and data: gpt (byte-level GPT on the Python stdlib's source), digits "
    "(GroupNorm CNN on scikit-learn's digits), minilm (fine-tune pretrained MiniLM on stdlib "
    "docstrings; minilm-pairs: contrastively, in-batch negatives), segment (U-Net segmenting "
    "256x256 procedural images; segment-batchnorm: the same with BatchNorm); minilm, "
    "minilm-pairs and segment set their own batch, budget and length",
    check=_recipe,
    choices=sorted(RECIPES),
)
HF_MODEL = Opt(
    None,
    "a Hugging Face causal LM from a local directory or config JSON (no hub); replaces --recipe",
    metavar="PATH",
)
SEED = Opt(0, "seed for initialization and data order", check=at_least(0))
EFFECTIVE_BATCH = Opt(
    RecipeDefault(64),
    "samples per optimizer step, over all processes (sequences for the LMs, images for digits)",
    check=at_least(1),
)
MICRO_BATCH = Opt(
    None, "samples per micro-batch; planned from --budget when not given", check=at_least(1)
)
REPLAN = Opt(
    False,
    "plan again although the plan cache holds this plan (kept under "
    "~/.cache/gradaccum/plans, keyed by everything the plan depends on: model, data "
    "shapes, budget, precision, device, versions)",
    resumable=True,  # a resumed run never plans: it has no effect there
)
BUDGET = Opt(
    RecipeDefault("512MB"),
    "memory budget for planning the micro-batch: bytes, or a number with B, KB, MB, GB "
    "(powers of 1000) or KiB, MiB, GiB (powers of 1024)",
    check=_bytes,
)
MARGIN = Opt(
    0.15,
    "fraction of the budget the plan keeps free: on CPU the same training run's resident "
    "memory varies from one process to the next",
    check=_fraction,
)
METER = Opt(
    "auto",
    "what memory means: auto (CUDA's allocator on a GPU, resident memory on CPU), rss, or "
    "tensors (live tensor bytes: deterministic, blind to the allocator's overheads, slow)",
    choices=METERS,
)
CHECKPOINTING_OPT = Opt(
    "off",
    "activation checkpointing of the model's repeated blocks: off, on, or auto (when the plan "
    "finds nothing fits without; with --prefer fastest, also timed against the sizes without "
    "it where it fits a larger one and measuring it fits in half the planning time)",
    choices=CHECKPOINTING,
)
PREFER_OPT = Opt(
    "fastest",
    "which micro-batch the plan takes among those that fit: fastest (the fewest seconds per "
    "effective batch, timed over real windows; the largest when timing cannot tell them "
    "apart) or largest (untimed)",
    choices=PREFER,
)
PRECISION = Opt("fp32", "fp32, bf16 (autocast) or fp16 (autocast + GradScaler)", choices=PRECISIONS)
PLAN_PRECISION = Opt(
    "fp32",
    "fp32, bf16 (autocast) or fp16 (autocast + GradScaler); for the estimate also bf16-true "
    "(every weight, gradient and optimizer state in bf16, no autocast: Lightning's and "
    "litgpt's precision='bf16-true')",
    choices=(*PRECISIONS, "bf16-true"),
)
SEQ_LEN = Opt(
    None,
    "tokens per sequence for --data (default: the model's own length, at most 128); "
    "documents are packed, prompt/completion pairs padded",
    check=at_least(2),
)
LORA = Opt(
    None,
    "train LoRA adapters of this rank on the frozen --hf-model (PEFT; pip install "
    "'gradaccum[finetune]')",
    check=at_least(1),
    metavar="R",
)
ESTIMATE_OPTIMIZERS = (
    "adamw",
    "adam",
    "sgd",
    "adafactor",
    "adamw8bit",
    "paged_adamw8bit",
    "lion8bit",
)
SHARD = Opt(
    "ddp",
    "how torchrun's processes hold the model: ddp (each a whole copy) or fsdp (FSDP2: each "
    "holds 1/N of the parameters, gradients and optimizer state; checkpoints through "
    "torch.distributed.checkpoint, and model.pt, the whole model, at the end)",
    choices=SHARDS,
)
ESTIMATE_TASKS = (
    "causal-lm",
    "masked-lm",
    "sequence-classification",
    "token-classification",
    "image-classification",
)
ESTIMATE_ONLY = (
    "task", "seq_len", "micro_batch", "quantize", "attn_implementation", "deepspeed",
)  # fmt: skip
QUANTIZED = ("8bit", "nf4", "fp4", "gptq")


@dataclass(kw_only=True)
class Source:
    """model and data"""

    recipe: str = RECIPE()
    hf_model: str | None = HF_MODEL()
    data: str | None = Opt(
        None,
        "train on your own text: a .txt file, a .jsonl file (a text field per line, or "
        "prompt/completion pairs) or a folder of them; with --recipe gpt (bytes) or --hf-model "
        "(its tokenizer)",
        metavar="PATH",
    )()
    text_field: str = Opt("text", "the .jsonl field that holds each document's text")()
    seq_len: int | None = SEQ_LEN()
    eval_fraction: float = Opt(
        0.1, "share of --data's sequences held out for evaluation (seeded)", check=_fraction
    )()
    seed: int = SEED()

    def problems(self) -> list[str]:
        if self.data is None and self.seq_len is not None:
            return ["seq_len applies to --data only; give --data PATH too"]
        return []


@dataclass(kw_only=True)
class Model:
    """LoRA adapters"""

    lora: int | None = LORA()
    lora_alpha: float | None = Opt(
        None, "LoRA scaling alpha (default: 2 x --lora)", check=_positive
    )()
    lora_dropout: float = Opt(0.0, "dropout on the LoRA input", check=_fraction)()
    lora_targets: str | None = Opt(
        None,
        "comma-separated layer names to adapt (default: the attention projections of common "
        "causal LMs, e.g. q_proj,v_proj or GPT-2's c_attn)",
        metavar="NAMES",
    )()

    def lora_arguments(self) -> dict[str, Any] | None:
        """``apply_lora``'s keyword arguments for these options; None without --lora."""
        if self.lora is None:
            return None
        targets = self.lora_targets.split(",") if self.lora_targets else None
        return {"r": self.lora, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "targets": targets}  # fmt: skip


@dataclass(kw_only=True)
class Batch:
    """the effective batch and its micro-batches"""

    effective_batch: int = EFFECTIVE_BATCH()
    micro_batch: int | None = MICRO_BATCH()
    batch_schedule: str = Opt(
        "constant",
        "how the effective batch changes, in whole micro-batches: constant; steps:S=B,... (B "
        "samples from step S on); samples:N=B,... (from N samples seen on); linear:N=B (a "
        "ramp from --effective-batch to B over N samples); auto (raised toward the measured "
        "critical batch, within --max-effective-batch)",
        metavar="SCHEDULE",
    )()
    max_effective_batch: int | None = Opt(
        None, "auto's ceiling (default: 8 x --effective-batch)", check=at_least(1)
    )()
    noise_scale: bool = Opt(
        True,
        "estimate the gradient noise scale (the critical batch) from each window; "
        "--no-noise-scale turns it off",
        resumable=True,
    )()

    def problems(self) -> list[str]:
        out = []
        if self.micro_batch is not None and self.micro_batch > self.effective_batch:
            out.append(
                f"micro_batch {self.micro_batch} is larger than effective_batch "
                f"{self.effective_batch}"
            )
        start = self.effective_batch if self.effective_batch >= 1 else 1
        out += schedule_problems(self.batch_schedule, start, 1, self.max_effective_batch)
        if self.batch_schedule == "auto" and not self.noise_scale:
            out.append("batch_schedule auto needs the noise scale: drop --no-noise-scale")
        if self.max_effective_batch is not None and self.batch_schedule != "auto":
            out.append("max_effective_batch applies to --batch-schedule auto only")
        return out


@dataclass(kw_only=True)
class Memory:
    """the memory budget the micro-batch is planned for"""

    budget: str = BUDGET()
    margin: float = MARGIN()
    meter: str = METER()
    checkpointing: str = CHECKPOINTING_OPT()
    prefer: str = PREFER_OPT()
    replan: bool = REPLAN()

    @property
    def budget_bytes(self) -> int:
        return parse_bytes(self.budget)


@dataclass(kw_only=True)
class Numerics:
    """precision and clipping"""

    precision: str = PRECISION()
    max_grad_norm: float | None = Opt(
        1.0,
        "clip the window's gradient to this global norm (0 turns clipping off)",
        check=_non_negative,
    )()
    compile: bool = Opt(
        False,
        "torch.compile the model's training forward (docs/compile.md): the first window "
        "compiles (a minute or more on a few cores), a ragged last window once more; one "
        "process only",
        resumable=True,  # the same arithmetic either way: a resume may turn it on or off
    )()


@dataclass(kw_only=True)
class Schedule:
    """optimizer, learning rate and length"""

    lr: float = Opt(RecipeDefault(3e-3), "peak learning rate (AdamW)", check=_positive)()
    weight_decay: float = Opt(0.01, "AdamW weight decay", check=_non_negative)()
    warmup_steps: int = Opt(
        RecipeDefault(10),
        "linear warm-up steps, then cosine decay to 10% of --lr",
        check=at_least(0),
    )()
    lr_scaling: str = Opt(
        "sqrt",
        "how --lr follows a scheduled batch: sqrt (x sqrt(B / B0), the rule for Adam), linear "
        "(x B / B0, the rule for SGD) or none; --lr is the rate at --effective-batch",
        choices=LR_RULES,
    )()
    steps: int | None = Opt(
        RecipeDefault(150), "optimizer steps to train", check=at_least(1), resumable=True
    )()
    epochs: float | None = Opt(
        None,
        "train this many passes over the data instead of --steps",
        check=_positive,
        resumable=True,
    )()
    samples: int | None = Opt(
        None,
        "train on this many samples instead of --steps (e.g. with a schedule)",
        check=at_least(1),
        resumable=True,
    )()

    def problems(self) -> list[str]:
        if self.samples is not None and self.epochs is not None:
            return ["give --samples or --epochs, not both"]
        return []


@dataclass(kw_only=True)
class Incidents:
    """the incident guard"""

    guard: bool = Opt(
        True,
        "the incident guard: a window whose loss (without clipping: or gradient norm) is far "
        "above the recent ones, or a run of skipped windows, rolls the run back to its last "
        "checkpoint and skips those windows' samples (incidents.jsonl); --no-guard turns it off",
        resumable=True,  # the way to train on past a run the guard stopped
    )()
    keep_checkpoints: int = Opt(
        2,
        "with the guard, keep the last K checkpoints under checkpoints/ (copies of their own: "
        "a rollback's target, and a resume's when checkpoint.pt is damaged)",
        check=at_least(1),
        metavar="K",
        resumable=True,
    )()


@dataclass(kw_only=True)
class TargetsConfig:
    """when to stop early"""

    target_loss: float | None = Opt(
        None,
        "stop when the held-out loss reaches this (checked at each evaluation: --eval-every)",
        check=_finite,
        metavar="LOSS",
        resumable=True,
    )()
    target_accuracy: float | None = Opt(
        None,
        "stop when the held-out accuracy reaches this, in (0, 1] (recipes that measure "
        "accuracy: digits, minilm, minilm-pairs)",
        check=_accuracy,
        metavar="ACC",
        resumable=True,
    )()
    max_time: str | None = Opt(
        None,
        "stop after this much training time over all sessions of the run: seconds, or 90s, 15m, 2h",
        check=_seconds,
        metavar="TIME",
        resumable=True,
    )()
    max_memory: str | None = Opt(
        None,
        "stop if the peak training memory reaches this: bytes or 2GiB, 1500MB, ...",
        check=_bytes,
        metavar="BYTES",
        resumable=True,
    )()

    def runtime(self) -> Targets:
        return Targets(
            target_loss=self.target_loss,
            target_accuracy=self.target_accuracy,
            max_time=None if self.max_time is None else parse_seconds(self.max_time),
            max_memory=None if self.max_memory is None else parse_bytes(self.max_memory),
        )


@dataclass(kw_only=True)
class Output:
    """the run folder, evaluation, checkpoints and exports"""

    out: str | None = Opt(None, "run folder (default: runs/RECIPE-TIME)", metavar="DIR")()
    resume: str | None = Opt(
        None,
        "continue the run in this folder exactly where its checkpoint stopped; options given "
        "with it override its saved config (e.g. a larger --steps)",
        metavar="DIR",
    )()
    config: str | None = Opt(
        None, "read options from a TOML or YAML file; flags override it", metavar="FILE"
    )()
    eval_every: int = Opt(
        RecipeDefault(50), "held-out evaluation every N steps", check=at_least(1), resumable=True
    )()
    checkpoint_every: int = Opt(
        RecipeDefault(50), "checkpoint every N steps", check=at_least(1), resumable=True
    )()
    export_every: int | None = Opt(
        None,
        "also export the weights every N steps (they are always exported at the end): the "
        "LoRA adapter, or the fine-tuned --hf-model, in Hugging Face format",
        check=at_least(1),
        resumable=True,
    )()
    merge_lora: bool = Opt(
        False, "with --lora, also export the base with the adapters merged in", resumable=True
    )()
    tensorboard: bool = Opt(
        True,
        "write TensorBoard event files under RUN/tensorboard when the tensorboard package is "
        "installed; --no-tensorboard turns them off",
        resumable=True,
    )()


@dataclass(kw_only=True)
class Distributed:
    """how torchrun's processes share the work"""

    pipeline_stages: int = Opt(
        1,
        "cut the model into this many pipeline stages, one per process (under torchrun "
        "--nproc-per-node S; --recipe gpt): each window's micro-batches stream through the "
        "stages, exactly",
        check=at_least(1),
        metavar="S",
    )()
    pipeline_schedule: str = Opt(
        "1f1b",
        "the pipeline's schedule: 1f1b (holds at most S micro-batches' activations) or gpipe "
        "(all of them)",
        choices=SCHEDULES,
    )()
    shard: str = SHARD()


# ----- types ---------------------------------------------------------------------------


def base_type(tp: Any) -> Any:
    """int for ``int``, str for ``str | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def type_problem(name: str, value: Any, tp: Any) -> str | None:
    """What is wrong with ``value``'s type for a field typed ``tp`` (an int is a float; a
    bool is neither), or None."""
    if value is None and _optional(tp):
        return None
    base = base_type(tp)
    if isinstance(value, bool) and base is not bool:
        ok = False
    elif base is float:
        ok = isinstance(value, (int, float))
    else:
        ok = isinstance(value, base)
    if not ok:
        return f"{name} must be {base.__name__}, got {value!r}"
    if base is int and not -(2**63) <= value < 2**63:  # torch's and numpy's int64
        return f"{name} must be an integer below 2**63, got {value}"
    return None


def _hints(cls: type) -> list[tuple[Any, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]


def _field_problems(obj: Any) -> list[str]:
    """Each field's type, then, where the type is right, its own check and choices."""
    out = []
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        if (problem := type_problem(f.name, value, hints[f.name])) is not None:
            out.append(problem)
            continue
        opt: Opt | None = f.metadata.get("opt")
        if value is None or opt is None:
            continue
        if opt.choices is not None and value not in opt.choices:
            out.append(f"{f.name} must be one of {', '.join(opt.choices)}, got {value!r}")
        elif opt.check is not None and (problem := opt.check(value)) is not None:
            if problem.startswith("must "):
                problem = f"{f.name} {problem}, got {value!r}"
            else:
                problem = f"{f.name}: {problem}"
            out.append(problem)
    return out


def _resolve_recipe_defaults(objs: typing.Iterable[Any], recipe: Any, hf_model: Any) -> None:
    """Each ``RecipeDefault`` left in ``objs`` becomes the recipe's own value, where it has
    one (not for --hf-model, which replaces the recipe), else the option's."""
    own = {}
    if hf_model is None and isinstance(recipe, str) and recipe in RECIPES:
        own = RECIPES[recipe].defaults
    for obj in objs:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, RecipeDefault):
                setattr(obj, f.name, own.get(f.name, value.value))


# ----- train -----------------------------------------------------------------------------

# section attribute -> its class, in --help's order
SECTIONS: dict[str, type] = {
    "source": Source,
    "model": Model,
    "batch": Batch,
    "memory": Memory,
    "numerics": Numerics,
    "schedule": Schedule,
    "incidents": Incidents,
    "targets": TargetsConfig,
    "output": Output,
    "distributed": Distributed,
}
# option name -> the section that holds it (names are unique across sections)
OPTION_SECTION: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in fields(cls)
}
assert len(OPTION_SECTION) == sum(len(fields(c)) for c in SECTIONS.values()), "a name twice"
# option name -> its type
HINTS: dict[str, Any] = {f.name: tp for cls in SECTIONS.values() for f, tp in _hints(cls)}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``gradaccum train`` runs with. ``TrainConfig.of(recipe="minilm", steps=5)``
    makes one from option names; ``flat()`` gives them back."""

    source: Source = field(default_factory=Source)
    model: Model = field(default_factory=Model)
    batch: Batch = field(default_factory=Batch)
    memory: Memory = field(default_factory=Memory)
    numerics: Numerics = field(default_factory=Numerics)
    schedule: Schedule = field(default_factory=Schedule)
    incidents: Incidents = field(default_factory=Incidents)
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    output: Output = field(default_factory=Output)
    distributed: Distributed = field(default_factory=Distributed)

    def __post_init__(self) -> None:
        _resolve_recipe_defaults(self.sections(), self.source.recipe, self.source.hf_model)

    @classmethod
    def of(cls, **options: Any) -> TrainConfig:
        """A configuration from option names (as flags, config files and config.json spell
        them); a name that is no option is refused."""
        unknown = sorted(set(options) - set(OPTION_SECTION))
        if unknown:
            raise ValueError(
                f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; known "
                f"options: {', '.join(sorted(OPTION_SECTION))}"
            )
        grouped: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in options.items():
            grouped[OPTION_SECTION[name]][name] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in grouped.items()})

    def sections(self) -> list[Any]:
        return [getattr(self, name) for name in SECTIONS]

    def flat(self) -> dict[str, Any]:
        """Option name -> value, every option: config.json's form."""
        return {f.name: getattr(s, f.name) for s in self.sections() for f in fields(s)}

    def problems(self) -> list[str]:
        """Every problem with this configuration, of type or of value, so a user fixes them in
        one pass. A check between options runs only when their own types are right."""
        out: list[str] = []
        for section in self.sections():
            out += _field_problems(section)
        if any(type_problem(k, v, HINTS[k]) for k, v in self.flat().items()):
            return out  # the checks between options read values of their own types
        for section in self.sections():
            if hasattr(section, "problems"):
                out += section.problems()
        return out + self._between_sections()

    def _between_sections(self) -> list[str]:
        src, model, num = self.source, self.model, self.numerics
        out = []
        if model.lora is not None and src.hf_model is None:
            out.append("lora needs --hf-model PATH: PEFT adapts Hugging Face models")
        if self.output.merge_lora and model.lora is None:
            out.append("merge_lora needs --lora R")
        if self.targets.target_accuracy is not None:
            recipe = RECIPES.get(src.recipe)
            if src.hf_model or src.data or recipe is None or "accuracy" not in recipe.metrics:
                measured = [n for n, r in sorted(RECIPES.items()) if "accuracy" in r.metrics]
                out.append(
                    "target_accuracy needs a recipe whose evaluation measures accuracy "
                    f"({', '.join(measured)}); this run measures held-out loss: use --target-loss"
                )
        dist = self.distributed
        if dist.shard == "fsdp":
            if dist.pipeline_stages != 1:
                out.append("shard fsdp with pipeline_stages: one or the other (2D is not built)")
            if model.lora is not None:
                out.append(
                    "shard fsdp with lora: the adapters are a few megabytes, nothing to shard; "
                    "use --shard ddp"
                )
            if num.precision == "fp16":
                out.append(
                    "shard fsdp with precision fp16: each rank would see only its own shards' "
                    "overflow; use --precision bf16"
                )
        if dist.pipeline_stages > 1:
            out += self._pipeline_problems()
        if num.compile and (dist.pipeline_stages > 1 or dist.shard == "fsdp"):
            out.append(
                "compile with pipeline_stages or shard fsdp: a compiled forward is tested on "
                "one process; drop --compile"
            )
        return out

    def _pipeline_problems(self) -> list[str]:
        """What a pipeline run does not do yet, each with what to use instead."""
        src, batch, stages = self.source, self.batch, self.distributed.pipeline_stages
        out = []
        if src.hf_model is not None or src.recipe != "gpt":
            out.append("pipeline_stages splits the built-in GPT only: use --recipe gpt")
        elif stages > GPT_SHAPE["n_layers"]:
            out.append(
                f"pipeline_stages {stages}: the GPT has {GPT_SHAPE['n_layers']} blocks, so at "
                f"most {GPT_SHAPE['n_layers']} stages"
            )
        if src.data is not None:
            out.append(
                "pipeline_stages with --data: a pipeline runs micro-batches of one shape, and "
                "your data's last window of an epoch is shorter; train it without a pipeline"
            )
        if batch.batch_schedule != "constant":
            out.append(
                "pipeline_stages needs a constant batch (the schedule runs one micro-batch "
                f"shape), not batch_schedule {batch.batch_schedule}"
            )
        if self.memory.checkpointing != "off":
            out.append("pipeline_stages runs without activation checkpointing: --checkpointing off")
        micro_size, effective = batch.micro_batch, batch.effective_batch
        if micro_size is not None and micro_size <= effective and effective % micro_size:
            out.append(
                f"pipeline_stages needs equal micro-batches: micro_batch {micro_size} does not "
                f"divide effective_batch {effective}"
            )
        return out


# What a resumed run may change: how long it trains and how it reports. Everything else
# defines the run and must stay as it was (a different run belongs in its own folder).
RESUMABLE = tuple(
    f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata["opt"].resumable
)


# ----- plan and check: the same options, where they mean the same ---------------------


@dataclass(kw_only=True)
class PlanConfig:
    """``gradaccum plan``: train's options for the model and the memory, and the plan's own."""

    recipe: str = RECIPE(help="built-in model and data to plan for")
    seed: int = SEED(help="seed for the model's initialization")
    effective_batch: int = EFFECTIVE_BATCH()
    world_size: int = Opt(1, "processes the effective batch is split over", check=at_least(1))()
    budget: str = BUDGET()
    margin: float = MARGIN()
    meter: str = METER()
    checkpointing: str = CHECKPOINTING_OPT()
    prefer: str = PREFER_OPT()
    precision: str = PLAN_PRECISION()
    export: str | None = Opt(
        None,
        "write the plan as this framework's file to stdout (the plan itself to stderr; with "
        "--json, the JSON plan carries it): "
        "DeepSpeed's config and TrainingArguments as JSON, Lightning's Trainer settings as "
        "YAML, Accelerator's as JSON; an equal micro-batch x accumulation steps x processes "
        "= the effective batch exactly",
        choices=FRAMEWORKS,
        metavar="FRAMEWORK",
    )()
    export_to: str | None = Opt(
        None,
        "write --export's file here instead of to stdout (stdout keeps the plan)",
        metavar="PATH",
    )()
    replan: bool = REPLAN()
    json: bool = Opt(False, "print the plan as JSON")()
    plot: str | None = Opt(
        None, "draw predicted vs measured memory per probed size to this PNG", metavar="FILE.png"
    )()
    # the estimate for a GPU that is not here (docs/planning.md, "Estimating for a GPU ...")
    device: str = Opt(
        "auto",
        "the device to plan for: auto (this machine), cpu, or cuda (measured on a GPU when one "
        "is here, else estimated with fake tensors)",
        choices=("auto", "cpu", "cuda"),
    )()
    estimate: bool = Opt(
        False,
        "estimate the CUDA peak with fake tensors (no GPU needed); with a GPU here, beside "
        "the measured plan",
    )()
    gpu: str | None = Opt(
        None,
        "the GPU the estimate is for: its constants (CUDA context, cuBLAS workspace) and, "
        "unless --budget is given, its memory as the budget (default: a generic 24 GB card)",
        choices=tuple(GPUS),
    )()
    hf_model: str | None = HF_MODEL(
        help="estimate a Hugging Face model from a local directory or config JSON (its "
        "config alone; weights never load) with its task head (--task); replaces --recipe"
    )
    task: str | None = Opt(
        None,
        "--hf-model's head (default: the one its config's architectures name, else causal-lm)",
        choices=tuple(ESTIMATE_TASKS),
    )()
    seq_len: int | None = SEQ_LEN(
        help="tokens per sequence of --hf-model's estimate (default: 128)"
    )
    optimizer: str = Opt(
        "adamw",
        "the estimate's optimizer: torch's, transformers' Adafactor, or bitsandbytes' 8-bit "
        "ones by their documented state layout",
        choices=ESTIMATE_OPTIMIZERS,
    )()
    lora: str | None = Opt(
        None,
        "estimate LoRA adapters on the frozen --hf-model (bf16 base under --precision bf16): "
        "a rank (the default attention projections), or a PEFT adapter_config.json or a "
        "folder holding one (its rank, alpha, dropout, target modules and modules to save)",
        check=_lora_spec,
        metavar="R|ADAPTER",
    )()
    micro_batch: int | None = MICRO_BATCH(
        help="estimate this micro-batch size alone (default: the largest that fits the budget)"
    )
    shard: str = SHARD(
        help="how --world-size's processes hold the model in the estimate: ddp (each a whole "
        "copy, with DistributedDataParallel's gradient buckets) or fsdp (FSDP2's fully_shard "
        "on each repeated block and the root; gradient sync 'window' where it fits, else "
        "'micro', as the plan chooses)"
    )
    deepspeed: str | None = Opt(
        None,
        "estimate the run under DeepSpeed with this configuration file (its ZeRO stage 1 or 2, "
        "bf16/fp16, reduce_bucket_size and overlap_comm; 'auto' as Hugging Face's Trainer "
        "fills it), on rank 0 of --world-size",
        check=_deepspeed_spec,
        metavar="CONFIG.json",
    )()
    quantize: str | None = Opt(
        None,
        "a frozen quantized base under --lora (QLoRA): bitsandbytes' 8bit (Linear8bitLt) or "
        "nf4, fp4 (Linear4bit), or gptq (auto-gptq's 4-bit QuantLinear, group size 128 unless "
        "--hf-model's quantization_config says), modelled by their layout",
        choices=QUANTIZED,
    )()
    double_quant: bool = Opt(
        False, "with --quantize nf4 or fp4: double quantization (bnb_4bit_use_double_quant)"
    )()
    attn_implementation: str | None = Opt(
        None,
        "--hf-model's attention as Hugging Face names it: eager (the attention matrix kept "
        "for backward), sdpa, or flash_attention_2 (modelled as CUDA's flash kernel; bf16 or "
        "fp16) (default: what transformers picks for the model)",
        choices=("eager", "sdpa", "flash_attention_2"),
    )()
    longest: bool = Opt(
        False,
        "with --hf-model, estimate the longest --seq-len whose window fits the budget at "
        "--micro-batch (default 1), up to the model's positions",
    )()
    trace_limit: float = Opt(
        300.0,
        "seconds the estimate's trace may take before it stops with the layer it was at",
        check=_positive,
        metavar="SECONDS",
    )()

    def __post_init__(self) -> None:
        # no --budget: the estimate's card's memory (decided in ``estimates``, which knows
        # whether the estimate is what runs: a measured plan keeps the recipe's budget)
        self.card_budget = isinstance(self.budget, RecipeDefault)
        _resolve_recipe_defaults([self], self.recipe, self.hf_model)

    def estimates(self, gpu_here: bool) -> bool:
        """Whether this plan is the fake-tensor estimate rather than a measurement; for an
        estimate without --budget, the card's memory becomes the budget."""
        estimating = self.estimate or (self.device == "cuda" and not gpu_here)
        if estimating and not gpu_here and getattr(self, "card_budget", False):
            self.budget = f"{GPUS[self.gpu or 'cuda'].memory}B"  # the answer is the estimate
        return estimating

    def budget_said(self) -> str:
        """Where the budget came from, in both units: the card's memory or --budget."""
        size = parse_bytes(self.budget)
        both = f"{size / 1e9:.1f} GB ({size / 2**30:.1f} GiB)"
        card = self.gpu or "cuda"
        if self.budget == f"{GPUS[card].memory}B":
            return f"{self.gpu or 'a generic 24 GB card'}'s memory, {both}"
        return f"--budget {self.budget}: {both}"

    def problems(self) -> list[str]:
        out = _field_problems(self)
        if self.export_to is not None and self.export is None:
            out.append("export_to needs --export FRAMEWORK: which framework's file to write")
        only = [f"--{n.replace('_', '-')}" for n in ESTIMATE_ONLY if getattr(self, n)]
        if self.lora is not None and not self.lora.isdigit():
            only.append("--lora ADAPTER (the measured plan takes a rank)")
        if only and not (self.estimate or self.device == "cuda"):
            out.append(
                f"{', '.join(only)} apply to the estimate: add --device cuda or --estimate "
                "(without them the plan measures on this machine)"
            )
        if self.lora is not None and self.hf_model is None:
            out.append("lora needs --hf-model PATH: PEFT adapts Hugging Face models")
        if self.seq_len is not None and self.hf_model is None:
            out.append("seq_len applies to --hf-model; a built-in recipe has its own length")
        if self.task is not None and self.hf_model is None:
            out.append("task applies to --hf-model; a built-in recipe has its own head")
        if self.shard == "fsdp":
            if not (self.estimate or self.device == "cuda"):
                out.append("shard fsdp applies to the estimate: add --device cuda or --estimate")
            if self.world_size < 2:
                out.append(f"shard fsdp needs --world-size 2 or more, got {self.world_size}")
            if self.quantize is not None:
                out.append("shard fsdp with --quantize: a sharded quantized base is not modelled")
        if self.precision == "bf16-true":
            if not (self.estimate or self.device == "cuda"):
                out.append("precision bf16-true applies to the estimate: add --device cuda")
            if self.deepspeed is not None:
                out.append("precision bf16-true with --deepspeed: its file's bf16 decides")
            if self.export is not None:
                out.append("precision bf16-true with --export: the exports take fp32, bf16, fp16")
        if self.deepspeed is not None and self.shard == "fsdp":
            out.append("deepspeed with --shard fsdp: a run is sharded by one or the other")
        if self.quantize is not None and self.lora is None:
            out.append("quantize needs --lora R: a quantized base trains adapters only")
        if self.double_quant and self.quantize not in ("nf4", "fp4"):
            out.append("double_quant needs --quantize nf4 or fp4")
        if self.attn_implementation is not None:
            if self.hf_model is None:
                out.append("attn_implementation applies to --hf-model; a recipe has its own")
            if self.attn_implementation == "flash_attention_2" and self.precision == "fp32":
                out.append("attn_implementation flash_attention_2 needs --precision bf16 or fp16")
        if self.longest:
            if self.hf_model is None or not (self.estimate or self.device == "cuda"):
                out.append("longest needs --hf-model PATH and --device cuda: it is the estimate's")
            if self.seq_len is not None:
                out.append("longest searches --seq-len: give one or the other")
            if self.checkpointing == "auto":
                out.append("longest with --checkpointing auto: choose on or off")
        return out


@dataclass(kw_only=True)
class CheckConfig:
    """``gradaccum check``: train's options for the model, and the batch compared."""

    recipe: str = RECIPE(help="built-in model and data to audit")
    hf_model: str | None = HF_MODEL(
        help="audit a Hugging Face causal LM from a local directory or config JSON instead"
    )
    seed: int = SEED(help="seed for the model and the batch")
    batch: int = Opt(16, "samples in the batch compared", check=at_least(2))()
    micro_batch: int = MICRO_BATCH(default=4, help="samples per micro-batch, fewer than --batch")
    tolerance: float | None = Opt(
        None,
        "the largest relative error per parameter that passes (default: the larger of the "
        "dtype's tolerance and 10 x the full batch's own rounding, measured against float64)",
        check=_positive,
    )()
    float64: bool = Opt(
        False, "compare in float64 (model and batch), where rounding all but vanishes"
    )()

    def problems(self) -> list[str]:
        out = _field_problems(self)
        if not out and self.micro_batch >= self.batch:
            out.append(
                f"micro_batch {self.micro_batch} must be smaller than batch {self.batch}: "
                "the check compares several micro-batches against the whole batch"
            )
        return out


# ----- train's one resolver: a resumed run's config, a config file, the flags ---------------

_FLAGS_ONLY = {"config": "--config FILE", "resume": "--resume DIR"}  # docs/cli.md says so
_FILE_KEYS = set(OPTION_SECTION) - set(_FLAGS_ONLY)
_LENGTH = ("steps", "epochs", "samples")  # how long the run trains: one of them


def resolve_train(flags: dict[str, Any]) -> TrainConfig:
    """`gradaccum train`'s one configuration from, in rising order: the options' and the
    recipe's defaults, a resumed run's saved config, a config file, the flags given
    (option name -> value); every problem of all of them in one ValueError."""
    values: dict[str, Any] = {}
    if flags.get("resume"):
        folder = RunFolder(flags["resume"])
        folder.check_usable(resume=True)
        saved = folder.read_json(CONFIG, needs=("effective_batch",))
        values.update({k: v for k, v in saved.items() if k in _FILE_KEYS})
        values["out"] = flags["resume"]
    from_file: dict[str, Any] = {}
    problems: list[str] = []
    if flags.get("config"):
        # the file's own problems are reported with every other one, in one pass
        from_file, problems = parse_config_file(flags["config"])
        values.update(from_file)
    values.update(flags)
    given = [k for k in _LENGTH if k in flags or k in from_file]
    if flags.get("resume") and given:
        # A length given with --resume replaces the saved one, in whichever unit: a run
        # begun with --epochs continues with --steps 300.
        values.update({k: None for k in _LENGTH if k not in given})
    cfg = TrainConfig.of(**values)
    problems += cfg.problems()
    for other in ("epochs", "samples"):
        if ("steps" in flags or "steps" in from_file) and values.get(other) is not None:
            problems.append(
                f"--steps and --{other} (here {values[other]!r}) both given: --{other} decides how "
                "long the run trains, so give one of them"
            )
    resume, out = cfg.output.resume, cfg.output.out
    if isinstance(resume, str) and isinstance(out, str) and not _same_folder(resume, out):
        problems.append(
            f"--out {out} and --resume {resume} name different folders; a resumed run stays "
            "in its folder"
        )
    if problems:
        raise ValueError(invalid_configuration(problems))
    return cfg


def _same_folder(a: str, b: str) -> bool:
    """Whether two spellings name one folder (relative or absolute, through links)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def read_config_file(path: str) -> dict[str, Any]:
    """TOML or YAML, parsed safely, into option names: flat keys, or keys under their
    section's table (``[batch]`` then ``effective_batch = 256``); dashes or underscores.
    Every problem of its keys (unknown, given twice, a flag only, a section as a value) is
    refused in one ValueError."""
    values, problems = parse_config_file(path)
    if problems:
        raise ValueError(invalid_configuration(problems))
    return values


def parse_config_file(path: str) -> tuple[dict[str, Any], list[str]]:
    """(option name -> value, every problem of the file's keys): the options it gives well,
    and what is wrong with the rest, each problem naming the file, so the caller reports
    them with the values' own problems in one pass. A file that cannot be read or parsed at
    all is a ValueError of its own."""
    data = _load_config_file(path)
    found: dict[str, tuple[str, Any]] = {}  # option -> (as written, value)
    twice, unknown, problems = [], [], []
    example = "[{0}]` then `{1} = ...`" if path.endswith(".toml") else "{0}:` then `  {1}: ...`"

    def add(key: str, value: Any, written: str, section: str | None = None) -> None:
        name = key.replace("-", "_")
        if name in _FLAGS_ONLY:
            problems.append(
                f"--config {path}: {written} cannot be set in a config file: it is a flag "
                f"only ({_FLAGS_ONLY[name]})"
            )
        elif name in SECTIONS and section is None:  # a section, given a value
            first = fields(SECTIONS[name])[0].name
            problems.append(
                f"--config {path}: {written} is a section (a table), not an option; write "
                f"`" + example.format(name, first) + f" (its options: "
                f"{', '.join(f.name for f in fields(SECTIONS[name]))})"
            )
        elif name not in OPTION_SECTION or (section and OPTION_SECTION[name] != section):
            home = OPTION_SECTION.get(name)
            unknown.append(written + (f" (it belongs under [{home}])" if home else ""))
        elif name in found:
            twice.append(f"{found[name][0]} and {written}")
        else:
            found[name] = (written, value)

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                add(str(inner), v, f"[{key}] {inner}", name)
        else:
            add(str(key), value, str(key))
    if twice:
        problems.append(f"--config {path}: the same option given twice: {'; '.join(twice)}")
    if unknown:
        near = [_nearest(u.split(" ")[-1]) for u in unknown]
        said = [
            u + (f" (did you mean {n}?)" if n and "belongs" not in u else "")
            for u, n in zip(unknown, near, strict=True)
        ]
        problems.append(
            f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(said)}; every option is listed in gradaccum train --help"
        )
    return {name: _coerce(name, value) for name, (_, value) in found.items()}, problems


def _load_config_file(path: str) -> dict[Any, Any]:
    """The file's table, parsed (TOML, or YAML with safe_load); ValueError naming the file
    when it is not one: a folder, missing, not UTF-8 text, not valid TOML or YAML."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(
            f"--config {path}: is a directory; --config takes a file (.toml, .yaml or .yml)"
        )
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    if file.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"--config {path}: use a .toml, .yaml or .yml file")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--config {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); a config file is TOML or YAML text"
        ) from None
    except OSError as err:
        raise ValueError(f"--config {path}: cannot be read ({err.strerror or err})") from None
    if file.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--config {path}: not valid TOML: {err}") from err
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--config {path}: not valid YAML: {_yaml_problem(err)}") from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of options, got {type(data).__name__}")
    return data


def _nearest(key: str) -> str | None:
    """The known option a mistyped key most likely means, as a file would write it."""
    import difflib

    name = key.replace("-", "_")
    if name in _OTHER_NAMES:
        return _OTHER_NAMES[name]
    found = difflib.get_close_matches(name, sorted(_FILE_KEYS), n=1, cutoff=0.6)
    return found[0].replace("_", "-") if found else None


# What other trainers call an option (Hugging Face's TrainingArguments, Lightning).
_OTHER_NAMES = {
    "learning_rate": "lr",
    "max_steps": "steps",
    "num_train_epochs": "epochs",
    "max_epochs": "epochs",
    "batch_size": "effective-batch",
    "per_device_train_batch_size": "micro-batch",
    "gradient_accumulation_steps": "effective-batch (micro-batches follow from --budget)",
    "accumulate_grad_batches": "effective-batch (micro-batches follow from --budget)",
    "warmup": "warmup-steps",
    "output_dir": "out",
}


def _yaml_problem(err: Exception) -> str:
    """PyYAML's several-line message as one: what it expected, and where."""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{what}{where}"


def _coerce(name: str, value: Any) -> Any:
    """A file's spellings taken as what they mean (flags are typed by argparse; a wrong type
    is left for the configuration's own check): YAML 1.1 reads ``2e-3`` (no dot) as a
    string, so a float option takes a string that is a number; the budget and
    --max-memory take a number of bytes, --max-time a number of seconds."""
    base = base_type(HINTS[name])
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if name in ("budget", "max_memory") and numeric and float(value).is_integer():
        return str(int(value))  # 5e8 in TOML or YAML is a float
    if name == "max_time" and numeric:
        return str(value)
    return value
