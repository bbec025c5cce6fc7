"""The main job: train a recipe with an exact large batch, plan its memory, keep a run folder.

``TrainConfig`` is the one source of defaults, help text and validation for
``gradaccum train`` (its fields' ``help`` are the CLI's --help). ``train(cfg)`` plans the
micro-batch, trains window by window through the Accumulator, and writes to ``cfg.out``:

    config.json      the resolved configuration
    plan.json        the plan (or the micro-batch given)
    metrics.jsonl    one line per optimizer step
    checkpoint.pt    at window boundaries every checkpoint_every steps, on SIGINT/SIGTERM
                     and at the end (torch.load(..., weights_only=True))
    summary.json     the final numbers; loss.png, memory.png and batch.png (the effective
                     batch against the critical batch B_simple)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradaccum import launch, plots
from gradaccum.batching import batch_size, shard, split, to_device
from gradaccum.engine import Accumulator
from gradaccum.guard import Incident, IncidentGuard
from gradaccum.measure import fresh_process_verifier
from gradaccum.memory import TrainingMemory, format_bytes, parse_bytes
from gradaccum.noise import NoiseScale, advice
from gradaccum.oom import OOMReplay
from gradaccum.plan import CHECKPOINTING, plan
from gradaccum.precision import PRECISIONS
from gradaccum.recipes import RECIPES, Recipe, get_recipe, hf_recipe
from gradaccum.recipes.userdata import DataError, SequenceData, load_sequences, save_cache
from gradaccum.recompute import enable_checkpointing
from gradaccum.runfolder import CHECKPOINT, CONFIG, INCIDENTS, METRICS, PLAN, RESUMES, RunFolder
from gradaccum.schedule import LR_RULES, BatchSchedule, lr_factor, schedule_problems
from gradaccum.targets import Targets, parse_seconds
from gradaccum.validate import int_problem, invalid_configuration

__all__ = ["Interrupted", "TrainConfig", "train"]


@dataclass(kw_only=True)
class TrainConfig:
    recipe: str = field(
        default="gpt",
        metadata={
            "help": "built-in model and data: gpt (byte-level GPT on the Python stdlib's source) "
            "or digits (GroupNorm CNN on scikit-learn's digits)",
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
        default=64,
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
        default="512MB",
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
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(
        default=10, metadata={"help": "linear warm-up steps, then cosine decay to 10% of --lr"}
    )
    steps: int | None = field(default=150, metadata={"help": "optimizer steps to train"})
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
    eval_every: int = field(default=50, metadata={"help": "held-out evaluation every N steps"})
    checkpoint_every: int = field(default=50, metadata={"help": "checkpoint every N steps"})
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


class Interrupted(Exception):  # noqa: N818 - it is a stop, not an error
    """Training stopped on a signal (SIGINT, SIGTERM, SIGHUP) or a closed output pipe, after
    checkpointing at a window boundary."""

    def __init__(self, step: int, out: Path, signum: int) -> None:
        why = "its output pipe closing" if signum == signal.SIGPIPE else signal.Signals(signum).name
        super().__init__(
            f"stopped by {why} at step {step}; checkpoint saved; "
            f"continue with: gradaccum train --resume {out}"
        )
        self.step, self.out, self.signum = step, out, signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GUARD_RETRIES = 3  # rollbacks in a row (no checkpoint between) before the guard stops the run
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
)


class _Output:
    """The log, surviving a closed pipe (``gradaccum train | head``): the first write that
    finds the reader gone stops training at the next window boundary, as SIGPIPE would, and
    later writes go nowhere."""

    def __init__(self, log, stop: list[int]) -> None:
        self.log, self.stop, self.closed = log, stop, False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.closed:
            return
        try:
            self.log(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            self.closed = True
            # Point stdout at /dev/null so the interpreter's own flush at exit cannot fail too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.stop.append(signal.SIGPIPE)


def _signature(recipe: Recipe, model: torch.nn.Module) -> dict[str, Any]:
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    return {
        **recipe.signature,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shapes": shapes,
    }


def _check_signature(saved: dict[str, Any], mine: dict[str, Any], path: Path) -> None:
    def describe(sig: dict[str, Any]) -> str:
        head = ", ".join(f"{k} {v}" for k, v in sig.items() if k not in ("shapes", "parameters"))
        return f"{head} ({sig.get('parameters', '?'):,} parameters)"

    if {k: v for k, v in saved.items() if k != "shapes"} != {
        k: v for k, v in mine.items() if k != "shapes"
    } or saved.get("shapes") != mine.get("shapes"):
        diff = [
            k for k in saved.get("shapes", {}) if saved["shapes"].get(k) != mine["shapes"].get(k)
        ]
        raise ValueError(
            f"{path} was written for another model: {describe(saved)}; this run builds "
            f"{describe(mine)}"
            + (f"; first differing tensors: {', '.join(diff[:3])}" if diff else "")
        )


def _progress(run: _Run):
    from tqdm import tqdm  # imported here: only a terminal needs it

    if not sys.stderr.isatty():
        return None
    # A terminal that reports no size (some ptys) would get an empty bar: fall back to 100.
    columns = shutil.get_terminal_size((100, 20)).columns or 100
    if run.total_samples is not None:
        total, done, unit = run.total_samples, run.schedule.samples, "sample"
    else:
        total, done, unit = run.total_steps, run.schedule.step, "step"
    return tqdm(total=total, initial=done, unit=unit, ncols=columns)


@dataclass
class _Run:
    """Everything built for a run, for the loop and the report. Its length is in steps
    (``total_steps``, from --steps) or in samples (``total_samples``, from --samples or
    --epochs); the schedule holds the position in both."""

    cfg: TrainConfig
    folder: RunFolder
    rank: int
    world: int
    recipe: Recipe
    model: torch.nn.Module
    device: torch.device
    data: Any
    optimizer: torch.optim.Optimizer
    acc: Accumulator
    micro: int
    checkpointing: bool
    signature: dict[str, Any]
    schedule: BatchSchedule
    start: int  # the step this session began at
    total_steps: int | None
    total_samples: int | None
    targets: Targets = field(default_factory=Targets)
    guard: IncidentGuard | None = None
    skips: list[list[int]] = field(default_factory=list)  # [first, end) samples set aside
    retries: int = 0  # rollbacks since the last regular checkpoint
    elapsed: float = 0.0  # training seconds over all sessions, as of the last window
    stopped_by: str = "length"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def progress(self) -> float:
        """The share of the run done, in its own unit."""
        if self.total_samples is not None:
            return self.schedule.samples / self.total_samples
        return self.schedule.step / self.total_steps

    def done(self) -> bool:
        return self.progress() >= 1

    def skip_ahead(self) -> None:
        """A window that would begin at samples the guard set aside begins after them."""
        moved = True
        while moved:
            moved = False
            for first, end in self.skips:
                if first <= self.schedule.samples < end:
                    self.schedule.samples, moved = end, True

    def next_size(self) -> int:
        """The next window's samples: the schedule's, cut to what the run has left."""
        size = self.schedule.size()
        if self.total_samples is not None:
            size = min(size, self.total_samples - self.schedule.samples)
        return size

    def lr(self, size: int) -> float:
        """The learning rate of the next window, a pure function of the position and the
        window's batch: linear warm-up over --warmup-steps windows, then cosine decay to 10%
        of --lr over the rest of the run, times the batch rule (--lr-scaling)."""
        cfg, step = self.cfg, self.schedule.step
        if step < cfg.warmup_steps:
            shape = (step + 1) / (cfg.warmup_steps + 1)
        else:
            if self.total_samples is not None:
                done, warm = self.schedule.samples, cfg.warmup_steps * cfg.effective_batch
                total = self.total_samples
            else:
                done, warm, total = step, cfg.warmup_steps, self.total_steps
            progress = (done - warm) / max(1, total - warm)
            shape = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
        return cfg.lr * shape * lr_factor(cfg.lr_scaling, size, cfg.effective_batch)

    def length(self) -> str:
        if self.total_samples is not None:
            return f"{self.total_samples:,} samples"
        return f"{self.total_steps} steps"


def train(cfg: TrainConfig, *, log=print, faults=None) -> dict[str, Any]:
    """Run (or resume) a training run; returns the summary. Raises ``Interrupted`` after
    checkpointing on SIGINT/SIGTERM/SIGHUP or a closed output pipe, ValueError on bad
    configuration or an unusable run folder (one line each).

    ``faults``: for tests of the incident guard only, ``faults(position, batch) -> batch``
    may damage the samples of chosen windows (see ``gradaccum.testing.corrupt_samples``)."""
    problems = cfg.problems()
    if problems:
        raise ValueError(invalid_configuration(problems))
    stop: list[int] = []
    # Under torchrun every process runs this function; rank 0 alone plans, writes the run
    # folder and reports. The effective batch is global: each rank trains its shard of it.
    rank, world = launch.init_from_env()
    log = _Output(log, stop) if rank == 0 else _quiet
    run = _build(cfg, rank, world, log)
    try:
        began = time.perf_counter()
        _loop(run, log, stop, faults)
        if not run.main:
            return {"rank": rank}
        return _report(run, log, time.perf_counter() - began)
    finally:
        run.folder.release()


def _build(cfg: TrainConfig, rank: int, world: int, log) -> _Run:
    """The run folder decided and locked, the model, data and optimizer, the micro-batch
    (from the checkpoint, the saved plan, the flag, or a new plan) and the Accumulator."""
    main = rank == 0
    if world > cfg.effective_batch:
        raise ValueError(
            f"effective_batch {cfg.effective_batch} cannot be split across {world} "
            "processes: each needs at least one sample"
        )
    recipe = hf_recipe(cfg.hf_model) if cfg.hf_model else get_recipe(cfg.recipe)
    name = "hf" if cfg.hf_model else cfg.recipe
    # Your own data is read and checked before anything is written: bad data leaves no folder.
    loaded = _user_data(cfg, recipe) if cfg.data else None
    folder = RunFolder(cfg.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    resuming = cfg.resume is not None
    problem = saved_cfg = None
    if main:
        try:
            folder.check_usable(resume=resuming)
            if resuming:
                saved_cfg = folder.read_json(CONFIG)
                _check_unchanged(saved_cfg, cfg, folder.path)
            folder.create()
        except ValueError as err:
            problem = str(err)
    if world > 1:  # rank 0's folder and verdict, so no rank races another's mkdir
        folder, problem = launch.broadcast((RunFolder(folder.path), problem))
    if problem:
        raise ValueError(problem)

    torch.manual_seed(cfg.seed)
    model = recipe.build_model()
    if cfg.lora is not None:
        from gradaccum import finetune

        targets = cfg.lora_targets.split(",") if cfg.lora_targets else None
        model = finetune.apply_lora(
            model, cfg.lora, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets
        )
        log(f"LoRA r={cfg.lora}: {finetune.trainable_summary(model)}")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0)
    model.to(device)
    if loaded is not None:
        data = SequenceData(loaded, cfg.seed, recipe.logits)
        recipe = dataclasses.replace(recipe, sample_batch=data.sample)
    else:
        data = recipe.make_data(cfg.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = total_samples = None
    if cfg.samples is not None or cfg.epochs is not None:
        total_samples = cfg.samples or max(1, round(cfg.epochs * data.epoch_samples()))
    else:
        total_steps = cfg.steps
    signature = _signature(recipe, model)
    saved = folder.load_checkpoint(device) if resuming else None
    if saved is not None:
        _check_signature(saved["signature"], signature, folder.path / CHECKPOINT)
        if "schedule" not in saved:
            saved["schedule"] = _constant_schedule_state(saved, cfg)
        # Before 0.3 a LambdaLR held the learning rate; it is now a function of the position.
        saved["accumulator"]["scheduler"] = None
        done = saved["schedule"]["samples"] if total_samples else saved["step"]
        if done > (total_samples or total_steps):
            unit = "samples" if total_samples else "steps"
            raise ValueError(
                f"--resume {folder.path}: the run has already trained {done} {unit}; give "
                f"--steps, --samples or --epochs of at least that"
            )
    if main and resuming:
        _record_resume(folder, saved_cfg, cfg, saved["step"] if saved else 0)
    elif main:
        folder.write_json(CONFIG, dataclasses.asdict(cfg))  # first: a crash is resumable
    if main and loaded is not None:
        save_cache(loaded, folder.path)  # a resume reads the sequences back
    micro, checkpointing = _micro_batch(
        cfg, folder, saved, model, optimizer, recipe, device, main, world, log
    )
    if cfg.batch_schedule == "auto" and micro * world >= cfg.effective_batch and saved is None:
        micro = max(1, math.ceil(cfg.effective_batch / world / 2))
        log(
            f"--batch-schedule auto measures the noise scale, which needs 2+ micro-batches "
            f"per window: micro-batch {micro}"
        )
    schedule = BatchSchedule(
        cfg.batch_schedule,
        start=cfg.effective_batch,
        unit=micro * world,
        maximum=cfg.max_effective_batch,
    )
    if saved is not None:
        schedule.load_state_dict(saved["schedule"])
    if resuming:
        where = f"step {schedule.step} of {total_steps}"
        if total_samples is not None:
            where = f"step {schedule.step}, sample {schedule.samples:,} of {total_samples:,}"
        log(f"resuming {folder.path} at {where} (micro-batch {micro})")

    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    acc = Accumulator(
        train_model,
        optimizer,
        max_grad_norm=cfg.max_grad_norm or None,
        precision=cfg.precision,
        oom=OOMReplay() if world == 1 else None,
        noise=NoiseScale() if cfg.noise_scale else None,
    )
    if saved is not None:
        acc.load_state_dict(saved["accumulator"])
    # With clipping, a gradient spike's step is already bounded: the loss tells damage.
    guard = IncidentGuard(gradient=not cfg.max_grad_norm) if cfg.guard else None
    if guard is not None and saved is not None and saved.get("guard") is not None:
        guard.load_state_dict(saved["guard"])
    run = _Run(
        cfg,
        folder,
        rank,
        world,
        recipe,
        model,
        device,
        data,
        optimizer,
        acc,
        micro,
        checkpointing,
        signature,
        schedule,
        schedule.step,
        total_steps,
        total_samples,
        targets=cfg.targets(),
        guard=guard,
    )
    if saved is not None:
        run.skips = [list(r) for r in saved.get("skips", [])]
        run.retries = int(saved.get("retries", 0))
        run.elapsed = float(saved.get("elapsed", 0.0))
        run.targets.observed = dict(saved.get("targets", {}))
    run.skip_ahead()
    return run


def _constant_schedule_state(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """The schedule's state for a checkpoint written before schedules (gradaccum < 0.3): a
    constant batch, so the position follows from the step."""
    if cfg.batch_schedule != "constant":
        raise ValueError("a checkpoint from before batch schedules resumes with a constant batch")
    step = saved["step"]
    return {
        "spec": "constant",
        "step": step,
        "samples": step * cfg.effective_batch,
        "items": saved["accumulator"]["accumulator"]["items"],
        "current": cfg.effective_batch,
        "changes": [],
    }


def _user_data(cfg: TrainConfig, recipe: Recipe) -> dict[str, Any]:
    """--data's sequences (tokenized now, or read back from a resumed run's folder), checked
    against the model and the effective batch."""
    if recipe.encoder is None:
        raise DataError(
            f"--data needs a language model: --recipe gpt or --hf-model PATH (not {recipe.name})"
        )
    encoder = recipe.encoder()
    seq_len = cfg.seq_len or min(128, encoder.max_len)
    loaded = load_sequences(
        cfg.data,
        encoder,
        seq_len=seq_len,
        eval_fraction=cfg.eval_fraction,
        seed=cfg.seed,
        text_field=cfg.text_field,
        cache=Path(cfg.resume) if cfg.resume else None,
    )
    if cfg.resume and not (Path(cfg.resume) / f"data-{loaded['key']}.pt").is_file():
        if any(Path(cfg.resume).glob("data-*.pt")):
            raise DataError(
                f"--resume {cfg.resume}: --data {cfg.data} is not the data this run began with "
                "(its files or the tokenizer changed); start a new run with --out"
            )
    sequences = len(loaded["train"][0])
    if sequences < cfg.effective_batch:
        raise DataError(
            f"--data {cfg.data}: {sequences} training sequences of {seq_len} tokens, fewer than "
            f"one effective batch ({cfg.effective_batch}); lower --effective-batch or --seq-len, "
            "or add data"
        )
    return loaded


def _check_unchanged(saved: dict[str, Any], cfg: TrainConfig, path: Path) -> None:
    """A resumed run may train longer or report differently; anything else would make it a
    different run recorded as this one. Refuse, naming each change."""
    mine = dataclasses.asdict(cfg)
    changed = [
        f"{k} {saved[k]!r} -> {mine[k]!r}"
        for k in mine
        if k not in (*RESUMABLE, "out", "resume", "config") and k in saved and saved[k] != mine[k]
    ]
    if changed:
        allowed = ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
        raise ValueError(
            f"--resume {path}: a resumed run keeps its configuration but for {allowed}; this "
            f"would change {'; '.join(changed)}. Start a new run with --out for that"
        )


def _record_resume(folder: RunFolder, saved: dict[str, Any], cfg: TrainConfig, start: int) -> None:
    """config.json becomes what the run now trains with; resumes.jsonl says what changed."""
    mine = dataclasses.asdict(cfg)
    changed = {k: [saved.get(k), mine[k]] for k in RESUMABLE if saved.get(k) != mine[k]}
    folder.append_line(RESUMES, {"step": start, "changed": changed})
    folder.write_json(CONFIG, {**saved, **{k: mine[k] for k in RESUMABLE}})


def _micro_batch(cfg, folder, saved, model, optimizer, recipe, device, main, world, log):
    """The micro-batch size and whether blocks recompute their activations: the checkpoint's,
    else the saved plan's (a run that stopped before its first checkpoint), else a new plan
    (or the flag's size). Whatever the source, checkpointing is applied here, so a resumed
    run trains as it was planned."""
    if saved is not None:
        # (a checkpoint written before checkpointing was recorded: it was never on then)
        info = {"micro_size": saved["micro_batch"], "checkpointing": saved.get("checkpointing")}
    elif cfg.resume is not None and (folder.path / PLAN).is_file():
        info = folder.read_json(PLAN)
    else:
        info = _plan_info(cfg, model, optimizer, recipe, device, main, world, log)
        if main:
            folder.write_json(PLAN, info)
    if info["checkpointing"]:
        enable_checkpointing(model)
    return info["micro_size"], bool(info["checkpointing"])


def _plan_info(cfg, model, optimizer, recipe, device, main, world, log) -> dict[str, Any]:
    if cfg.micro_batch is not None:
        return {
            "micro_size": cfg.micro_batch,
            "source": "given",
            "checkpointing": cfg.checkpointing == "on",
        }
    per_rank = math.ceil(cfg.effective_batch / world)
    info = None
    if main:  # one plan for all ranks (same model and hardware)
        log(
            f"planning the micro-batch for an effective batch of {per_rank} per process in "
            f"{cfg.budget} ({recipe.summary})"
        )
        verify = None
        if not cfg.hf_model and not cfg.data and device.type == "cpu":
            verify = fresh_process_verifier(cfg.recipe, cfg.precision, cfg.seed)
        planned = plan(
            model,
            optimizer,
            recipe.sample_batch(8),
            recipe.loss_fn,
            effective_batch=per_rank,
            budget=cfg.budget,
            precision=cfg.precision,
            checkpointing=cfg.checkpointing,
            verify=verify,
        )
        log(planned.summary())
        info = {**planned.to_dict(), "source": "planned"}
    if world > 1:
        info = launch.broadcast(info)
    return info


def _loop(run: _Run, log, stop: list[int], faults=None) -> None:
    """Window by window from the run's position: a metrics line per step, a checkpoint every
    checkpoint_every steps, at the end, and at the boundary after a stop was asked for or a
    target was met; with the guard, a rollback after each incident."""
    cfg, folder, schedule = run.cfg, run.folder, run.schedule
    windows = math.ceil(math.ceil(cfg.effective_batch / run.world) / run.micro)
    across = f" on each of {run.world} processes" if run.world > 1 else ""
    log(
        f"training {run.length()}: effective batch {cfg.effective_batch} = {windows} "
        f"micro-batches of up to {run.micro}{across}"
        + ("" if schedule.kind == "constant" else f"; schedule: {schedule.describe()}")
        + f"; {run.data.epoch_samples():,} samples per epoch; run folder {folder.path}"
    )
    if run.targets.describe():
        log(f"targets: {run.targets.describe()}")
    previous = {s: signal.signal(s, lambda signum, _: stop.append(signum)) for s in STOP_SIGNALS}
    memory = TrainingMemory(run.model, run.device)
    bar = _progress(run) if run.main else None
    metrics = folder.open_metrics(run.start) if run.main else open(os.devnull, "w")
    events = _events(run, log)
    began, items, last = time.perf_counter(), 0, run.start
    before = run.elapsed  # training seconds of earlier sessions
    # (step, first sample, end sample) of the latest windows: what an incident blames
    recent: list[tuple[int, int, int]] = []
    if run.guard is not None and not folder.kept_checkpoints() and run.main:
        _checkpoint(run, run.start, last)  # something to roll back to from the first window
    try:
        while not run.done():
            t0 = time.perf_counter()
            size, progress = run.next_size(), run.progress()
            lr = run.lr(size)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            first = schedule.samples
            batch = run.data.batch(first, size)
            if faults is not None:
                batch = faults(first, batch)
            samples = batch_size(batch)  # fewer than size at the end of an epoch
            if run.world > 1:
                batch = shard(batch, run.rank, run.world)
            if run.device.type == "cuda":
                batch = to_device(batch, run.device)
            result = run.acc.step(split(batch, run.micro), run.recipe.loss_fn)
            schedule.update(result, samples)
            if run.world > 1 and schedule.kind == "auto":
                # Each rank reads the noise off its own prefixes: rank 0's decision holds.
                schedule.current = launch.main_int(schedule.current)
            step = schedule.step
            recent = [*recent[-20:], (step, first, first + samples)]
            run.elapsed = before + time.perf_counter() - began
            # The loss and gradient norm are global, so every rank judges alike.
            incident = (
                None
                if run.guard is None
                else run.guard.check(result.loss, result.grad_norm, result.skipped is not None)
            )
            if incident is not None:
                gave_up = _rollback(run, incident, recent[-incident.windows :], log)
                metrics.close()
                metrics = folder.open_metrics(schedule.step) if run.main else open(os.devnull, "w")
                if events is not None:
                    events.restart(schedule.step)
                if bar is not None:
                    bar.n = schedule.samples if run.total_samples is not None else schedule.step
                    bar.refresh()
                recent, last = [], schedule.step
                if gave_up:
                    run.stopped_by = "guard"
                    break
                continue
            run.skip_ahead()
            items += result.count
            interval = result.noise_interval or (None, None)
            line = {
                "step": step,
                "samples": schedule.samples,
                "effective_batch": samples,
                "loss": result.loss,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "count": result.count,
                "micro_batches": result.micro_batches,
                "seconds": time.perf_counter() - t0,
                "peak_memory": memory.peak(),
                "skipped": result.skipped,
                "oom_replays": result.oom_replays,
                "noise_scale": result.noise_scale,
                "noise_low": interval[0],
                "noise_high": interval[1],
            }
            end = run.done()
            limit = run.targets.limit_reached(run.elapsed, line["peak_memory"])
            if run.main and (step % cfg.eval_every == 0 or end or limit):
                evaluated = run.data.evaluate(run.model, run.micro)
                line.update({f"eval_{k}": v for k, v in evaluated.items()})
            hit = run.targets.check(line, run.elapsed) if run.main else None
            _write_line(metrics, line, folder, last)
            if events is not None:
                events.write(line, run.acc.state)
            rate = items / max(time.perf_counter() - began, 1e-9)
            _report_step(bar, log, line, rate, run, progress)
            if run.world > 1:
                hit = launch.broadcast(hit)  # rank 0 evaluates: its verdict stops every rank
                if launch.any_rank(bool(stop)) and not stop:
                    stop.append(signal.SIGTERM)  # another rank was signalled: stop together
            if stop or hit or step % cfg.checkpoint_every == 0 or end:
                run.retries = 0  # the windows up to here passed the guard
                _checkpoint(run, step, last)
                last = step
            if cfg.export_every and step % cfg.export_every == 0 or end or hit:
                _export(run, log)
            if stop:
                raise Interrupted(step, folder.path, stop[0])
            if hit:
                run.stopped_by = hit
                log(f"stopping at step {step}: {_hit_text(run.targets, hit)}")
                break
    finally:
        metrics.close()
        if events is not None:
            events.close()
        if bar is not None:
            bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hit_text(targets: Targets, name: str) -> str:
    seen = targets.observed[name]["value"]
    if name == "target_loss":
        return f"held-out loss {seen:.4f} <= target {targets.target_loss:g}"
    if name == "target_accuracy":
        return f"held-out accuracy {seen:.4f} >= target {targets.target_accuracy:g}"
    if name == "max_time":
        return f"{seen:.1f} s of training reached --max-time ({targets.max_time:g} s)"
    return (
        f"peak memory {format_bytes(seen)} reached --max-memory "
        f"({format_bytes(targets.max_memory or 0)})"
    )


def _events(run: _Run, log):
    """The TensorBoard writer (rank 0, when asked for and installed), else None."""
    from gradaccum import events

    if not (run.main and run.cfg.tensorboard):
        return None
    if not events.available():
        log(
            "TensorBoard: the tensorboard package is not installed, so no event files "
            "(pip install 'gradaccum[tensorboard]'); metrics.jsonl has every number"
        )
        return None
    return events.EventLog(run.folder.path, run.start, run.cfg.max_grad_norm or None)


def _rollback(run: _Run, incident: Incident, blamed: list[tuple[int, int, int]], log) -> bool:
    """Back to the newest kept checkpoint from before the blamed windows, their samples set
    aside, the incident recorded. Returns True when the guard gives up: after as many
    rollbacks in a row as GUARD_RETRIES without a checkpoint between, the run stops there."""
    step = blamed[-1][0]
    kept = [(s, f) for s, f in run.folder.kept_checkpoints() if s < blamed[0][0]]
    if not kept:  # cannot happen while the folder is intact: the run keeps its first state
        raise ValueError(
            f"the incident guard found a {incident.kind} at step {step} but {run.folder.path} "
            "holds no kept checkpoint to roll back to; resume with --no-guard"
        )
    back, file = kept[-1]
    saved = run.folder.load_checkpoint(run.device, file)
    run.acc.load_state_dict(saved["accumulator"])
    run.schedule.load_state_dict(saved["schedule"])
    if saved.get("guard") is not None:
        run.guard.load_state_dict(saved["guard"])
    run.targets.observed = dict(saved.get("targets", {}))
    gave_up = run.retries >= GUARD_RETRIES
    span = [blamed[0][1], blamed[-1][2]]
    if gave_up:
        action = (
            f"stopped: {run.retries} rollbacks in a row did not get past it; the run is back "
            f"at step {back}, its last good checkpoint"
        )
    else:
        run.retries += 1
        for _, first, end in blamed:
            if [first, end] not in run.skips:
                run.skips.append([first, end])
        run.skip_ahead()
        action = (
            f"rolled back to step {back}; samples {span[0]:,} to {span[1]:,} set aside "
            f"(rollback {run.retries} of at most {GUARD_RETRIES} in a row)"
        )
    if run.main:
        # The checkpoint again, now with the samples set aside: a resumed run decides alike.
        _checkpoint(run, back, back)
        seen = {k: round(v, 6) for k, v in incident.seen.items()}
        record = {
            "step": step,
            "samples": span,
            "kind": incident.kind,
            "seen": seen,
            "action": action,
            "rolled_back_to": back,
            "retry": run.retries,
        }
        run.folder.append_line(INCIDENTS, record)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in incident.seen.items())
    log(f"incident at step {step}: {incident.kind} ({shown}); {action}")
    return gave_up


def _write_line(metrics, line: dict[str, Any], folder: RunFolder, last: int) -> None:
    try:
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()
    except OSError as err:
        what = f"cannot write {folder.path / METRICS}: {err.strerror or err}"
        raise ValueError(_stopped(folder, what, last)) from None


def _checkpoint(run: _Run, step: int, last: int) -> None:
    if not run.main:
        return
    state = {
        "step": step,
        "micro_batch": run.micro,
        "checkpointing": run.checkpointing,
        "signature": run.signature,
        "schedule": run.schedule.state_dict(),
        "accumulator": run.acc.state_dict(),
        "guard": None if run.guard is None else run.guard.state_dict(),
        "skips": run.skips,
        "retries": run.retries,
        "elapsed": run.elapsed,
        "targets": run.targets.observed,
    }
    try:
        run.folder.save_checkpoint(state)
        if run.guard is not None:
            run.folder.keep_checkpoint(step, run.cfg.keep_checkpoints)
    except ValueError as err:
        raise ValueError(_stopped(run.folder, str(err), last)) from None


def _export(run: _Run, log) -> None:
    """The weights in formats other tools load, under ``export/`` in the run folder: the LoRA
    adapter (PEFT's save_pretrained), with --merge-lora the merged model, and for a full
    fine-tune of --hf-model the model itself (save_pretrained, safetensors), the tokenizer
    beside each. Each folder is written whole (a temporary sibling, then a rename)."""
    cfg = run.cfg
    if not run.main or cfg.hf_model is None:
        return
    from gradaccum import finetune

    tokenizer = _tokenizer(cfg.hf_model)
    out = run.folder.path / "export"
    if cfg.lora is not None:
        written = [finetune.save_adapter(run.model, out / "adapter")]
        if cfg.merge_lora:
            written.append(finetune.save_merged(run.model, out / "merged", tokenizer))
    else:
        written = [finetune.save_full(run.model, out / "model", tokenizer)]
    log("exported " + ", ".join(str(w) for w in written))


@functools.cache  # read once per run, however often it exports
def _tokenizer(path: str):
    if not (Path(path) / "tokenizer.json").is_file():
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _stopped(folder: RunFolder, what: str, last: int) -> str:
    kept = f"its last checkpoint (step {last}) is kept" if last else "no checkpoint yet"
    return (
        f"{what}; training stopped, {kept}; free the space and continue with: "
        f"gradaccum train --resume {folder.path}"
    )


def _report(run: _Run, log, seconds: float) -> dict[str, Any]:
    """summary.json, the plots and the summary table, from metrics.jsonl and the counters."""
    cfg, acc, out = run.cfg, run.acc, run.folder.path
    lines = run.folder.metrics()
    last_eval = {}
    if lines:
        last_eval = {k[5:]: v for k, v in lines[-1].items() if k.startswith("eval_")}
    if run.schedule.step == run.start and run.stopped_by == "length":
        log(f"{out} already trained {run.length()}; nothing to do")
    if not last_eval:  # nothing trained, or the guard stopped the run at a rollback
        last_eval = run.data.evaluate(run.model, run.micro)
    summary = _summarize(lines, acc, last_eval, seconds, run.device)
    incidents = run.folder.lines(INCIDENTS)
    schedule = run.schedule
    reading = None if acc.noise is None else acc.noise.reading()
    # B_simple is in items (tokens for the language models); the batch is in samples.
    batch_items = round(schedule.size() * acc.state.items / max(schedule.samples, 1))
    summary.update(
        {
            "samples": schedule.samples,
            "effective_batch_final": schedule.size(),
            "batch_changes": [list(c) for c in schedule.changes],
            "noise_scale": None if reading is None else reading.value,
            "noise_interval": None if reading is None else reading.interval,
            "noise_advice": advice(batch_items, reading),
            "run_folder": str(out),
            "stopped_by": run.stopped_by,
            "targets": run.targets.summary(),
            "incidents": len(incidents),
        }
    )
    run.folder.write_json("summary.json", summary)
    plots.draw(out, lines, incidents)
    from gradaccum.report import write_report

    write_report(out)
    log(_summary_table(summary))
    if cfg.noise_scale:
        log(summary["noise_advice"])
    return summary


def _quiet(*args: Any, **kwargs: Any) -> None:
    """The log of ranks other than 0: rank 0 speaks for the job."""


def _report_step(bar, log, line: dict[str, Any], rate: float, run: _Run, before: float) -> None:
    """The bar's postfix on a terminal; else a log line at each tenth of the run, at its end
    and at each evaluation (``before``: the share of the run done before this step)."""
    loss = "skipped" if line["loss"] is None else f"{line['loss']:.3f}"
    text = f"loss {loss}  {rate:,.0f} items/s  mem {format_bytes(line['peak_memory'])}" + (
        f"  held-out {line['eval_loss']:.3f}" if "eval_loss" in line else ""
    )
    if bar is not None:
        bar.set_postfix_str(text)
        bar.update(line["effective_batch"] if run.total_samples is not None else 1)
        return
    now = run.progress()
    if int(now * 10) > int(before * 10) or now >= 1 or "eval_loss" in line:
        where = (
            f"{line['samples']:>7,}/{run.total_samples:,} samples"
            if run.total_samples is not None
            else f"{line['step']:>5}/{run.total_steps}"
        )
        log(f"step {where}  {text}")


def _summarize(
    lines: list[dict[str, Any]],
    acc: Accumulator,
    last_eval: dict[str, float],
    seconds: float,
    device: torch.device,
) -> dict[str, Any]:
    losses = [x["loss"] for x in lines if x["loss"] is not None]
    tail = losses[-10:]
    summary = {
        "steps": acc.state.optimizer_steps,
        "windows": acc.state.windows,
        "skipped_windows": acc.state.skipped_windows,
        "oom_replays": acc.state.oom_replays,
        "items": acc.state.items,
        "seconds_this_session": seconds,
        "first_loss": losses[0] if losses else None,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        **{f"held_out_{k}": v for k, v in last_eval.items()},
        "peak_memory": max((x["peak_memory"] for x in lines), default=0),
        "device": str(device),
    }
    return summary


def _summary_table(s: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    rows = [
        ("optimizer steps", s["steps"]),
        ("samples seen", s["samples"]),
        ("items seen", s["items"]),
        ("effective batch at the end", s["effective_batch_final"]),
        ("time (this session)", f"{s['seconds_this_session']:.1f} s"),
        (
            "train loss (first -> last 10 steps)",
            f"{fmt(s['first_loss'])} -> {fmt(s['final_train_loss'])}",
        ),
        *[(k.replace("_", " "), fmt(v)) for k, v in s.items() if k.startswith("held_out")],
        ("peak training memory", format_bytes(s["peak_memory"])),
        ("skipped windows", s["skipped_windows"]),
        ("out-of-memory replays", s["oom_replays"]),
        ("incidents (rolled back)", s["incidents"]),
        ("stopped by", _STOPPED[s["stopped_by"]]),
        *[
            (name.replace("_", " "), _target_text(t))
            for name, t in s["targets"].items()
            if t["status"] != "not set"
        ],
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "summary", "-" * (width + 24)] + [f"{k:<{width}}  {v}" for k, v in rows])


_STOPPED = {
    "length": "its length (trained all it was asked)",
    "target_loss": "--target-loss met",
    "target_accuracy": "--target-accuracy met",
    "max_time": "--max-time reached",
    "max_memory": "--max-memory reached",
    "guard": "the incident guard (see incidents.jsonl)",
}


def _target_text(t: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    when = f" at step {t['step']}" if t["step"] is not None else ""
    return f"{t['status']}{when} (limit {show(t['limit'])}, observed {show(t['value'])})"
