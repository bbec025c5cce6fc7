"""Everything a run needs before its first window: the run folder decided and locked, the
model, data, optimizer and Accumulator, the micro-batch (checkpoint, saved plan, flag or a
new plan), and the checks a resume must pass."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch
from gradaccum.app.config import RESUMABLE, TrainConfig
from gradaccum.app.folder import BASELINE, CHECKPOINT, CONFIG, PLAN, RESUMES, RunFolder
from gradaccum.app.guard import IncidentGuard
from gradaccum.app.kinds import Pipelined, Replicated, RunKind, Sharded
from gradaccum.app.loop import _Run
from gradaccum.app.measure import fresh_process_verifier
from gradaccum.app.recipes import Recipe, get_recipe, hf_recipe
from gradaccum.app.recipes.userdata import DataError, SequenceData, load_sequences, save_cache
from gradaccum.checkpoint import preserved_rng
from gradaccum.engine import Accumulator
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay
from gradaccum.pipeline import ChainedStages, PipelineWindow
from gradaccum.plan import plan
from gradaccum.precision import PRECISIONS
from gradaccum.recompute import enable_checkpointing
from gradaccum.schedule import BatchSchedule


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


def _build(cfg: TrainConfig, rank: int, world: int, log) -> _Run:
    """The run folder decided and locked, the model, data and optimizer, the micro-batch
    (from the checkpoint, the saved plan, the flag, or a new plan) and the Accumulator."""
    main = rank == 0
    stages = cfg.pipeline_stages
    if stages > 1 and world != stages:
        raise ValueError(
            f"--pipeline-stages {stages} runs one stage per process: launch it with torchrun "
            f"--nproc-per-node {stages} (this job has {world} process{'es' * (world > 1)}; "
            "pipeline replicas under data parallelism are not built yet)"
        )
    if cfg.shard == "fsdp" and world < 2:
        raise ValueError(
            "--shard fsdp shards the model over torchrun's processes and this job has one: "
            "launch it with torchrun --nproc-per-node N (N >= 2)"
        )
    replicas = world // stages  # data-parallel copies; a pipeline's stages share the batch
    if replicas > cfg.effective_batch:
        raise ValueError(
            f"effective_batch {cfg.effective_batch} cannot be split across {replicas} "
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
        from gradaccum.integrations import peft as finetune

        targets = cfg.lora_targets.split(",") if cfg.lora_targets else None
        model = finetune.apply_lora(
            model, cfg.lora, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets
        )
        log(f"LoRA r={cfg.lora}: {finetune.trainable_summary(model)}")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0)
    signature = _signature(recipe, model)  # the whole model's, on every stage
    if stages > 1:
        from gradaccum.app.recipes.gpt import GPTStage

        model = GPTStage(model, rank, stages)  # this process's part; the rest is dropped
    model.to(device)
    kind = _kind(cfg, rank, world, model)
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
    saved = kind.load_saved(folder, device) if resuming else None
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
    sharded = cfg.shard == "fsdp"
    if sharded:
        # The baseline first, on rank 0's whole model (its embedding passes in micro-batches
        # of 8); sharding then starts every rank from rank 0's parameters. The plan is made
        # on the shards, each rank measuring its own memory.
        if main and not resuming and hasattr(data, "baseline"):
            _baseline(folder, data, model, cfg.micro_batch or 8, log)
        model = _fully_shard(model, log)
        # The shards' parameters replace the model's: the optimizer is made over them.
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )
    micro, checkpointing, sync = _micro_batch(
        cfg, folder, saved, model, optimizer, recipe, device, main, world, log
    )
    if main and not resuming and hasattr(data, "baseline") and not sharded:
        _baseline(folder, data, model, micro, log)
    if cfg.batch_schedule == "auto" and micro * replicas >= cfg.effective_batch and saved is None:
        micro = max(1, math.ceil(cfg.effective_batch / replicas / 2))
        log(
            f"--batch-schedule auto measures the noise scale, which needs 2+ micro-batches "
            f"per window: micro-batch {micro}"
        )
    schedule = BatchSchedule(
        cfg.batch_schedule,
        start=cfg.effective_batch,
        unit=micro * replicas,
        maximum=cfg.max_effective_batch,
    )

    if stages > 1:
        acc = _pipeline_window(cfg, rank, world, model, device, optimizer, micro, log)
    else:
        train_model = model
        if replicas > 1 and not sharded:
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None
            )
        acc = Accumulator(
            train_model,
            optimizer,
            max_grad_norm=cfg.max_grad_norm or None,
            precision=cfg.precision,
            # Under DDP the ranks replay together, at the price of the window's reduction
            # no longer overlapping its last backward: worth it where memory runs out (CUDA).
            oom=OOMReplay()
            if world == 1 or (device.type == "cuda" and cfg.shard == "ddp")
            else None,
            noise=NoiseScale() if cfg.noise_scale else None,
            sync=sync,
        )
    # With clipping, a gradient spike's step is already bounded: the loss tells damage.
    guard = IncidentGuard(gradient=not cfg.max_grad_norm) if cfg.guard else None
    run = _Run(
        cfg=cfg,
        folder=folder,
        kind=kind,
        recipe=recipe,
        model=model,
        device=device,
        data=data,
        optimizer=optimizer,
        acc=acc,
        micro=micro,
        checkpointing=checkpointing,
        signature=signature,
        schedule=schedule,
        start=0,
        total_steps=total_steps,
        total_samples=total_samples,
        targets=cfg.targets(),
        guard=guard,
    )
    if saved is not None:
        run.restore(saved)
    if resuming:
        where = f"step {schedule.step} of {total_steps}"
        if total_samples is not None:
            where = f"step {schedule.step}, sample {schedule.samples:,} of {total_samples:,}"
        log(f"resuming {folder.path} at {where} (micro-batch {micro})")
    run.skip_ahead()
    return run


def _kind(cfg: TrainConfig, rank: int, world: int, model: torch.nn.Module) -> RunKind:
    """The kind of run the configuration and the job make (checked by ``_build`` first)."""
    if cfg.pipeline_stages > 1:
        return Pipelined(rank, world, cfg.pipeline_schedule, ChainedStages(model))
    if cfg.shard == "fsdp":
        return Sharded(rank, world)
    return Replicated(rank, world)


def _pipeline_window(cfg, rank, world, module, device, optimizer, micro, log):
    """This stage's ``PipelineWindow``: its part of the model as a ``PipelineStage``, the
    window's micro-batches of ``micro``, the tied head's copies kept equal."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.loss import causal_lm_loss

    if cfg.noise_scale:
        log(
            "the noise scale is not measured through a pipeline: the schedule runs the "
            "window's micro-batches inside one call, so their separate gradients are not seen"
        )
    return PipelineWindow(
        PipelineStage(module, rank, world, device),
        optimizer,
        causal_lm_loss,
        cfg.effective_batch // micro,
        schedule=cfg.pipeline_schedule,
        max_grad_norm=cfg.max_grad_norm or None,
        tied=module.tied(),
        precision=cfg.precision,
    )


def _fully_shard(model: torch.nn.Module, log) -> torch.nn.Module:
    """FSDP2 over the job's processes: each repeated block (a transformer's layers) its own
    unit, gathered only while it computes, then the root for the rest. Every rank starts
    from rank 0's parameters, as DistributedDataParallel starts (a baseline fitted on rank 0
    alone, minilm's probe head, reaches every rank so)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gradaccum.recompute import repeated_blocks

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    blocks = repeated_blocks(model)
    for _, block in blocks:
        fully_shard(block)
    fully_shard(model)
    world = dist.get_world_size()
    log(
        f"FSDP2 over {world} processes: {len(blocks)} blocks and the root, each rank holding "
        f"1/{world} of the parameters, gradients and optimizer state"
    )
    return model


def _baseline(folder: RunFolder, data: Any, model: torch.nn.Module, micro: int, log) -> None:
    """What the untrained model scores by the recipe's simpler method (a linear probe on the
    pretrained encoder), measured once before training into baseline.json; the summary sets
    the run's result against it. Drawn from no generator the run uses. The recipe may start
    the model from it (minilm's head starts from the probe's): rank 0 alone measures it, and
    DistributedDataParallel copies rank 0's parameters to every rank when it wraps the
    model, after this."""
    log("measuring the baseline before training ...")
    with preserved_rng():
        result = data.baseline(model, micro)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "name")
    log(f"baseline ({result['name']}): held-out {shown}")
    folder.write_json(BASELINE, result)


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
        info = {
            "micro_size": saved["micro_batch"],
            "checkpointing": saved.get("checkpointing"),
            "sync": saved.get("sync", "window"),
        }
    elif cfg.resume is not None and (folder.path / PLAN).is_file():
        info = folder.read_json(PLAN)
    else:
        if cfg.pipeline_stages > 1:
            info = _pipeline_plan_info(cfg, model, main, log)
        else:
            info = _plan_info(cfg, model, optimizer, recipe, device, main, world, log)
        if main:
            folder.write_json(PLAN, info)
    if info["checkpointing"]:
        enable_checkpointing(model)
    return info["micro_size"], bool(info["checkpointing"]), info.get("sync", "window")


def _plan_info(cfg, model, optimizer, recipe, device, main, world, log) -> dict[str, Any]:
    if cfg.micro_batch is not None:
        return {
            "micro_size": cfg.micro_batch,
            "source": "given",
            "checkpointing": cfg.checkpointing == "on",
        }
    per_rank = math.ceil(cfg.effective_batch / world)
    # One plan for all ranks (same model and hardware): rank 0's, broadcast. Under FSDP2
    # every rank plans its own shards together (gathers are collectives; the fullest rank's
    # measurements decide, so all arrive at one plan), with sync "auto": the window's one
    # reduce-scatter when the unsharded gradient fits between micro-batches, else one per
    # micro-batch.
    sharded = cfg.shard == "fsdp"
    info = None
    if main or sharded:
        log(
            f"planning the micro-batch{' and gradient sync' if sharded else ''} for an "
            f"effective batch of {per_rank} per process in {cfg.budget}"
            + (", each process measuring its shards" if sharded else "")
            + f" ({recipe.summary})"
        )
        verify = None
        if not sharded and not cfg.hf_model and not cfg.data and device.type == "cpu":
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
            sync="auto" if sharded else "window",
        )
        log(planned.summary())
        info = {**planned.to_dict(), "source": "planned"}
    if world > 1 and not sharded:
        info = launch.broadcast(info)
    return info


def _pipeline_plan_info(cfg: TrainConfig, module, main: bool, log) -> dict[str, Any]:
    """The number of micro-batches through the pipeline: each stage counts its own memory
    (parameters, gradients, AdamW's two states; the activations it saves per sample), the
    fullest stage's numbers decide (one all-reduce), and rank 0 logs the plan. Activations
    are measured under the run's autocast, as the stages will run."""
    import torch.distributed as dist

    from gradaccum.loss import causal_lm_loss
    from gradaccum.memory import parse_bytes
    from gradaccum.pipeline import measure_stage, plan_micro_batches

    if cfg.micro_batch is not None:
        return {"micro_size": cfg.micro_batch, "source": "given", "checkpointing": False}

    def loss(out: torch.Tensor) -> torch.Tensor:
        if module.is_last:
            return causal_lm_loss(out, torch.zeros(out.shape[:2], dtype=torch.long))[0]
        # Multiplying by its own values makes autograd keep the stage's output, as the
        # stage keeps it for the gradient the next stage sends back.
        return (out * out.detach()).sum()

    autocast = PRECISIONS[cfg.precision]
    device_type = next(module.parameters()).device.type
    with preserved_rng(), torch.autocast(device_type, autocast, enabled=autocast is not None):
        static, per_sample = measure_stage(module, module.sample_input, loss)
    fullest = torch.tensor([float(static), per_sample], dtype=torch.float64)
    dist.all_reduce(fullest, op=dist.ReduceOp.MAX)
    planned = plan_micro_batches(
        cfg.effective_batch,
        cfg.pipeline_stages,
        cfg.pipeline_schedule,
        int(fullest[0]),
        float(fullest[1]),
        parse_bytes(cfg.budget),
    )
    log(planned.summary())
    return {
        "micro_size": planned.micro_size,
        "source": "planned",
        "checkpointing": False,
        "pipeline": planned.to_dict(),
    }
