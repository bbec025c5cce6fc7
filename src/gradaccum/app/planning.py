"""The run's micro-batch: the checkpoint's, else the saved plan's, else the flag's, else a new
plan, which the kind of run makes (``RunKind.plan``: one plan for every rank, each rank's
shards, or a pipeline's micro-batch count). Library errors name API arguments; these are the
command's, so the plan's advice is translated into flags here."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch
from gradaccum.app.checkpoints import sealed
from gradaccum.app.config import PlanConfig, TrainConfig, resolve_train
from gradaccum.app.exports import write_exports
from gradaccum.app.folder import CHECKPOINT, PLAN, RunFolder
from gradaccum.app.fresh import Child, PlanRun
from gradaccum.app.measure import FreshProcessVerifier, fresh_process_verifier
from gradaccum.app.planner import Planner
from gradaccum.app.recipes import Recipe
from gradaccum.app.recipes.userdata import SequenceData
from gradaccum.batching import largest_share
from gradaccum.checkpoint import preserved_rng
from gradaccum.planning import Plan, PlanRequest
from gradaccum.precision import PRECISIONS
from gradaccum.recompute import enable_checkpointing

# the library's argument -> the command's flag, for advice written as name=value
FLAGS = {
    "budget": "--budget",
    "checkpointing": "--checkpointing",
    "effective_batch": "--effective-batch",
    "micro_size": "--micro-batch",
    "schedule": "--pipeline-schedule",
    "precision": "--precision",
}


def as_flags(message: str) -> str:
    """``checkpointing='auto'`` in a library error as ``--checkpointing auto``."""

    def flag(match: re.Match) -> str:
        return f"{FLAGS[match.group(1)]} {match.group(3)}"

    names = "|".join(FLAGS)
    return re.sub(rf"\b({names})=(['\"]?)([\w.]+)\2", flag, message)


def micro_size(
    cfg: TrainConfig,
    folder: RunFolder,
    saved: dict[str, Any] | None,
    kind: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: Recipe,
    device: torch.device,
    log,
    data: Any = None,
    cached: dict[str, Any] | None = None,
) -> tuple[int, bool, str, int | None]:
    """(micro-batch size, whether blocks recompute their activations, gradient sync,
    evaluation's own micro-batch or None). Whatever the source, checkpointing is applied
    here, so a resumed run trains as it was planned. plan.json is a record of the library's
    ``Plan`` (``Plan.to_dict()``), in its words: ``micro_size`` is the size the command's
    --micro-batch gives. ``cached``: the plan read from the cache before the model was
    built (``cached_plan``), taken as a new plan would be."""
    if saved is not None:
        # (a checkpoint written before checkpointing was recorded: it was never on then)
        info = {
            "micro_size": saved["micro_batch"],
            "checkpointing": saved.get("checkpointing"),
            "sync": saved.get("sync", "window"),
        }
    elif cfg.output.resume is not None and (folder.path / PLAN).is_file():
        # (rank 0 checked it before the resume wrote anything: RunFolder.check_resumable)
        info = folder.read_json(PLAN, needs=("micro_size", "checkpointing"))
    elif cfg.batch.micro_batch is not None:
        info = {
            "micro_size": cfg.batch.micro_batch,
            "source": "given",
            "checkpointing": cfg.memory.checkpointing == "on",
        }
        if kind.main:
            folder.write_json(PLAN, info)
    else:
        try:
            info = kind.plan(cfg, model, optimizer, recipe, device, log, data, cached=cached)
        except ValueError as err:
            raise ValueError(as_flags(str(err))) from err
        if kind.main:
            folder.write_json(PLAN, info)
    if info["checkpointing"]:
        enable_checkpointing(model)
    planned = info
    if "phases" not in info and (folder.path / PLAN).is_file():  # a resume: the plan's own
        planned = folder.read_json(PLAN, needs=("micro_size",))
    eval_micro_size = next(
        (p["micro_size"] for p in planned.get("phases", ()) if p["name"] == "evaluation"), None
    )
    return (
        info["micro_size"],
        bool(info["checkpointing"]),
        info.get("sync", "window"),
        eval_micro_size,
    )


def window_plan(
    cfg: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: Recipe,
    device: torch.device,
    rank: int,
    world: int,
    log,
    *,
    each_rank: bool,
    data: Any = None,
    here: bool = False,
    started: FreshProcessVerifier | None = None,
    cached: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The micro-batch of an Accumulator's window. One plan for all ranks (same model and
    hardware): rank 0's, broadcast; or, ``each_rank`` (FSDP2), every rank planning its own
    shards together (gathers are collectives; the fullest rank's measurements decide, so all
    arrive at one plan), with sync "auto": the window's one reduce-scatter when the
    unsharded gradient fits between micro-batches, else one per micro-batch.

    On the CPU, one process's plan is made in a process of its own (``_plan_elsewhere``)
    unless ``here``: probing leaves the planning process holding memory a fresh one does not
    (kernels' caches, freed blocks, the phases' imports), which training would then sit
    on. ``started``: the verifier ``here`` plans with, started before the model was built.
    ``cached``: rank 0's plan, already read from the cache (``cached_plan``).
    """
    info = None
    if cached is not None and rank == 0 and not each_rank:
        info = cached
    elif rank == 0 or each_rank:
        # (FSDP2's plans are collectives of every rank: each rank plans, never from a file)
        asked = request(cfg, world, each_rank)
        planner = run_planner(cfg, asked, device, world, log, cached=not each_rank)
        if here or each_rank or world > 1 or device.type != "cpu":

            def make() -> dict[str, Any]:
                # (FSDP2's evaluation is a collective of every rank: its plan is the window's)
                phases = (
                    None if each_rank or data is None else run_phases(cfg, model, optimizer, data)
                )
                return _plan_now(
                    cfg,
                    (model, optimizer, recipe.sample_batch(8)),
                    asked,
                    recipe,
                    device,
                    log,
                    phases,
                    started,
                )

            info = planner.plan(make)
        else:  # the plan process stores what it makes in the cache itself
            info = planner.plan(lambda: _plan_elsewhere(cfg, data, log), keep=False)
    if world > 1 and not each_rank:
        info = launch.broadcast(info)
    return info


def cached_plan(cfg: TrainConfig, device: torch.device, world: int, log) -> dict[str, Any] | None:
    """Rank 0's plan from the cache, read before the model and data are built (the key needs
    neither: ``cache_settings`` and the files'), so a rerun's plan is answered at once; None
    when none is stored, or --replan."""
    asked = request(cfg, world, each_rank=False)
    return run_planner(cfg, asked, device, world, log).answer()


def train_plan_for(cfg: PlanConfig, device: torch.device, log) -> Plan | None:
    """The plan `gradaccum train` stored for what `gradaccum plan` asks (a built-in recipe
    on one process, train's other options at their defaults: the demo's `train --budget
    200MB` and `plan --budget 200MB`), said in a line; None where there is none, or the
    question is one train would not have asked so (--hf-model, --lora, --world-size, or
    --replan). Train's plan covers the window and the run's evaluations and checkpoints, so
    it answers `plan` too: one cache entry for the same settings, not a second measurement."""
    if cfg.replan or cfg.hf_model or cfg.lora or cfg.world_size != 1:
        return None
    flags = {f: getattr(cfg, f) for f in _ASKED_OF_BOTH}
    try:
        train = resolve_train(flags)
    except ValueError:
        return None
    asked = request(train, 1, each_rank=False)
    found = run_planner(train, asked, device, 1, lambda _line: None).stored()
    if found is None:
        return None
    log(
        "the plan is the one `gradaccum train` made for these settings (the window, and the "
        "run's evaluations and checkpoints too; --replan measures the window alone)"
    )
    return found[0]


# what `gradaccum plan` and `gradaccum train` both ask of a recipe's plan
_ASKED_OF_BOTH = (
    "recipe seed effective_batch budget margin meter checkpointing prefer precision".split()
)


def run_planner(
    cfg: TrainConfig, asked: PlanRequest, device: torch.device, world: int, log, cached=True
) -> Planner:
    """The planner of a run's plan: keyed by its settings and its model's and data's files."""
    return Planner(
        device, cache_settings(cfg, asked, world), (cfg.source.hf_model, cfg.source.data),
        log=log, replan=cfg.memory.replan, cached=cached,
    )  # fmt: skip


def _plan_elsewhere(cfg: TrainConfig, data: Any, log) -> dict[str, Any]:
    """The plan, made in a fresh process (``fresh.PlanRun``) on the run's configuration (and
    --data's sequences, handed over in a file): it builds the model and data as the run does,
    plans, stores the plan in the cache and hands it back. Its lines are this run's log
    lines; its refusal (a budget too small) is this run's, in one line. If this process
    dies, the child's stdin closes and it exits."""
    with tempfile.TemporaryDirectory(prefix="gradaccum-plan-") as tmp:
        sequences = None
        if isinstance(data, SequenceData):
            sequences = str(Path(tmp) / "sequences.pt")
            train, held = (data.ids, data.labels), (data.eval_ids, data.eval_labels)
            torch.save({"train": train, "eval": held}, sequences)
        # this process has just read the cache (and named an entry it could not use)
        request = PlanRun(config={**cfg.flat(), "replan": True}, sequences=sequences)
        with Child(request) as child:
            return child.result(log, what="planning")


def _plan_now(
    cfg: TrainConfig,
    built: tuple[torch.nn.Module, torch.optim.Optimizer, Any],
    asked: PlanRequest,
    recipe: Recipe,
    device: torch.device,
    log,
    phases: dict[str, Callable[[int], Any]] | None,
    started: FreshProcessVerifier | None,
) -> dict[str, Any]:
    """A new plan, measured (rank 0's, or with sync "auto" every rank's together)."""
    each_rank = asked.sync == "auto"
    log(
        f"planning the micro-batch{' and gradient sync' if each_rank else ''} for an "
        f"effective batch of {asked.effective_batch} per process in {cfg.memory.budget}"
        + (", each process measuring its shards" if each_rank else "")
        + f" ({recipe.summary})"
    )
    with tempfile.TemporaryDirectory(prefix="gradaccum-plan-") as tmp, ExitStack() as stack:
        verify = None
        if not each_rank and device.type == "cpu":
            # On CPU the planned size is measured in a fresh process, where training will
            # run: this one's heap is shaped by the probes (CUDA's allocator is precise here).
            verify = stack.enter_context(_verifier(cfg, built[2], Path(tmp), started))
        planned = Planner.measure(*built, recipe.loss_fn, asked, verify=verify, phases=phases)
    log(planned.summary())
    return {**planned.to_dict(), "source": "planned"}


def verifier(cfg: TrainConfig) -> FreshProcessVerifier:
    """The fresh-process verification of this run's model: a recipe's, or --hf-model's with
    its LoRA adapters. Its first process starts now and builds while the caller goes on."""
    src = cfg.source
    return fresh_process_verifier(
        src.recipe, cfg.numerics.precision, src.seed, cfg.memory.meter,
        hf_model=src.hf_model, lora=cfg.model.lora_arguments(),
    )  # fmt: skip


def _verifier(cfg: TrainConfig, sample: Any, tmp: Path, started: FreshProcessVerifier | None):
    """``started`` (or a new verifier), trained on the sample batch where the run trains on
    --data or a Hugging Face model's data."""
    verify = started if started is not None else verifier(cfg)
    if cfg.source.hf_model or cfg.source.data:
        verify.sample = str(tmp / "sample.pt")
        torch.save(sample, verify.sample)
    return verify


# The run's options that cannot change what its plan measures: its length and stops, its
# cadences, its output, the learning rate. Every other option keys the plan cache.
NOT_PLANNED = frozenset(
    "steps epochs samples target_loss target_accuracy max_time max_memory out resume config "
    "eval_every checkpoint_every export_every keep_checkpoints replan tensorboard guard lr "
    "weight_decay warmup_steps lr_scaling".split()
)


def cache_settings(cfg: TrainConfig, asked: PlanRequest, world: int) -> dict[str, Any]:
    """What a run's plan depends on beside its files, known before the model is built: the
    run's configuration (the recipe, its data and model options, LoRA, the exports) less
    ``NOT_PLANNED``, the request, and the processes it is split over."""
    run = {k: v for k, v in cfg.flat().items() if k not in NOT_PLANNED}
    return {"run": run, **asked.to_dict(), "world": world}


def request(cfg: TrainConfig, world: int, each_rank: bool) -> PlanRequest:
    """What a run asks of its plan: the per-rank batch of its fullest process
    (``largest_share`` of the effective batch over ``world``, as ``shard`` splits it) in its
    budget, with its settings; one process plans it, as a request of one rank."""
    return PlanRequest(
        effective_batch=largest_share(cfg.batch.effective_batch, world),
        budget=cfg.memory.budget_bytes,
        margin=cfg.memory.margin,
        meter=cfg.memory.meter,
        checkpointing=cfg.memory.checkpointing,
        precision=cfg.numerics.precision,
        sync="auto" if each_rank else "window",
        prefer=cfg.memory.prefer,
    )


# Evaluation's memory is one micro-batch's at a time: two of them measure it.
_EVAL_MICRO_BATCHES = 2


def run_phases(
    cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any
) -> dict[str, Callable[[int], Any]]:
    """The run's parts other than its windows, as ``plan(phases=...)`` measures them: a
    held-out evaluation (two micro-batches of it), a checkpoint written and read back into
    the model and optimizer (what a resume or the guard's rollback does), and with
    --hf-model the exports (a LoRA merge copies the whole model), each into a temporary
    folder that is removed after."""

    def evaluation(size: int) -> None:
        data.evaluate(model, size, limit=size * _EVAL_MICRO_BATCHES)

    def checkpoint(size: int) -> None:
        with tempfile.TemporaryDirectory(prefix="gradaccum-plan-") as tmp:
            file = Path(tmp) / CHECKPOINT
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(sealed(state), file)
            del state
            back = torch.load(file, weights_only=True)
            model.load_state_dict(back["model"])
            optimizer.load_state_dict(back["optimizer"])

    def export(size: int) -> None:
        with tempfile.TemporaryDirectory(prefix="gradaccum-plan-") as tmp:
            write_exports(cfg, model, Path(tmp))

    phases: dict[str, Callable[[int], Any]] = {"evaluation": evaluation, "checkpoint": checkpoint}
    if cfg.source.hf_model is not None:
        phases["export"] = export
    return phases


def pipeline_plan(cfg: TrainConfig, module: Any, log) -> dict[str, Any]:
    """The number of micro-batches through the pipeline: each stage counts its own memory
    (parameters, gradients, AdamW's two states; the activations it saves per sample), the
    fullest stage's numbers decide (one all-reduce), and rank 0 logs the plan. Activations
    are measured under the run's autocast, as the stages will run."""
    import torch.distributed as dist

    from gradaccum.loss import causal_lm_loss
    from gradaccum.planning.pipeline import measure_stage, plan_micro_batches

    def loss(out: torch.Tensor) -> torch.Tensor:
        if module.is_last:
            return causal_lm_loss(out, torch.zeros(out.shape[:2], dtype=torch.long))[0]
        # Multiplying by its own values makes autograd keep the stage's output, as the
        # stage keeps it for the gradient the next stage sends back.
        return (out * out.detach()).sum()

    autocast = PRECISIONS[cfg.numerics.precision]
    device_type = next(module.parameters()).device.type
    with preserved_rng(), torch.autocast(device_type, autocast, enabled=autocast is not None):
        static, per_sample = measure_stage(module, module.sample_input, loss)
    fullest = torch.tensor([float(static), per_sample], dtype=torch.float64)
    dist.all_reduce(fullest, op=dist.ReduceOp.MAX)
    planned = plan_micro_batches(
        cfg.batch.effective_batch,
        cfg.distributed.pipeline_stages,
        cfg.distributed.pipeline_schedule,
        int(fullest[0]),
        float(fullest[1]),
        cfg.memory.budget_bytes,
        margin=cfg.memory.margin,
    )
    log(planned.summary())
    return {
        "micro_size": planned.micro_size,
        "source": "planned",
        "checkpointing": False,
        "pipeline": planned.to_dict(),
    }
