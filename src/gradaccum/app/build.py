"""Everything a run needs before its first window: the run folder decided and locked, the
model, data, optimizer and window runner (each as the kind of run makes it), the micro-batch
(app/planning.py), and the checks a resume must pass."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch, planning
from gradaccum.app.checkpoints import PROCESSES, Checkpoints, NewerCheckpoint
from gradaccum.app.config import RESUMABLE, TrainConfig
from gradaccum.app.folder import BASELINE, CHECKPOINT, CONFIG, RESUMES, SUMMARY, RunFolder
from gradaccum.app.guard import IncidentGuard
from gradaccum.app.kinds import RunKind
from gradaccum.app.recipes import Recipe, get_recipe, hf_recipe
from gradaccum.app.recipes.userdata import DataError, SequenceData, load_sequences, save_cache
from gradaccum.app.run import Progress, Run
from gradaccum.batching import largest_share
from gradaccum.checkpoint import preserved_rng
from gradaccum.memory import Resident
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


def build_run(cfg: TrainConfig, rank: int = 0, world: int = 1, log=print) -> Run:
    """The run folder decided and locked, the model, data and optimizer, the micro-batch
    (from the checkpoint, the saved plan, the flag, or a new plan) and the window runner;
    on a resume, the state of its checkpoint. ``rank`` and ``world``: this process's place
    in a torchrun job (``launch.init_from_env``)."""
    main = rank == 0
    kind = RunKind.of(cfg, rank, world)  # the job checked: how to launch it, if it does not fit
    effective = cfg.batch.effective_batch
    if kind.replicas > effective:
        raise ValueError(
            f"effective_batch {effective} cannot be split across {kind.replicas} "
            "processes: each needs at least one sample"
        )
    src = cfg.source
    recipe = hf_recipe(src.hf_model) if src.hf_model else get_recipe(src.recipe)
    name = "hf" if src.hf_model else src.recipe
    # Your own data is read and checked before anything is written: bad data leaves no folder.
    loaded = _user_data(cfg, recipe) if src.data else None
    folder = RunFolder(cfg.output.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    resuming = cfg.output.resume is not None
    problem = saved_cfg = None
    if main:
        try:
            folder.open(resume=resuming, log=log)
            if resuming:
                saved_cfg = folder.read_json(CONFIG, needs=("effective_batch",))
                _check_unchanged(saved_cfg, cfg, folder.path)
                folder.check_resumable()
        except ValueError as err:
            problem = str(err)
            folder.abandon()
    # rank 0's folder and verdict, so no rank races another's mkdir (rank 0 keeps its lock)
    path, problem = launch.broadcast((folder.path, problem))
    if not main:
        folder = RunFolder(path)
    if problem:
        raise ValueError(problem)
    try:
        # A stored plan is answered before the model and data are built (its key needs
        # neither): a rerun says its plan at once.
        cached = None
        if not resuming and cfg.batch.micro_batch is None:
            cached = kind.cached(cfg, run_device(), log)
        return _assemble(cfg, kind, recipe, loaded, folder, saved_cfg, log, cached)
    except BaseException:
        # Failed before the first step (a bad option found late, the plan, Ctrl-C): nothing
        # is left that would refuse the same command, fixed (RunFolder.abandon).
        folder.abandon()
        raise


def build_model(cfg: TrainConfig, recipe: Recipe, log) -> torch.nn.Module:
    """The run's model from its seed, with its LoRA adapters (on the CPU, whole)."""
    torch.manual_seed(cfg.source.seed)
    model = recipe.build_model()
    lora = cfg.model.lora_arguments()
    if lora is not None:
        from gradaccum.integrations import peft as finetune

        model = finetune.apply_lora(model, **lora)
        log(f"LoRA r={lora['r']}: {finetune.trainable_summary(model)}")
    return model


def run_data(cfg: TrainConfig, recipe: Recipe, loaded: dict[str, Any] | None):
    """(recipe, data): --data's sequences (``loaded``), the recipe's sample batch then drawn
    from them, or the recipe's own data."""
    if loaded is None:
        return recipe, recipe.make_data(cfg.source.seed)
    data = SequenceData(loaded, cfg.source.seed, recipe.logits)
    model_only = recipe.summary.split(" on the Python stdlib")[0]  # not its own data
    summary = f"{model_only} on --data {cfg.source.data}"
    return dataclasses.replace(recipe, sample_batch=data.sample, summary=summary), data


def compiled(recipe: Recipe, model: torch.nn.Module, kind: RunKind, log) -> Recipe:
    """The recipe with its training loss on ``torch.compile(model)``: the compiled module
    shares the model's parameters, so the Accumulator, checkpoints (the model's own keys),
    evaluation and the plan (measured eagerly) see the model itself. ``dynamic=None``:
    torch compiles the first shape statically and, on a second (a ragged last window, a
    new sequence length), once more with that dimension dynamic, then no more."""
    if kind.world > 1:
        raise ValueError(
            f"--compile runs on one process (this run has {kind.world}): a compiled forward "
            "under DDP is not tested here; drop --compile or run one process"
        )
    forward = torch.compile(model, dynamic=None)
    log("--compile: the training forward compiles on the first window (torch.compile)")
    loss_fn = recipe.loss_fn

    def compiled_loss(_model: torch.nn.Module, batch: Any):
        return loss_fn(forward, batch)

    return dataclasses.replace(recipe, loss_fn=compiled_loss)


def run_device() -> torch.device:
    """This process's device: its CUDA device under torchrun (LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    return torch.optim.AdamW(trainable, lr=cfg.schedule.lr, weight_decay=cfg.schedule.weight_decay)


def _assemble(cfg, kind, recipe, loaded, folder, saved_cfg, log, cached=None) -> Run:
    """The model, data, optimizer, micro-batch and window runner, in the opened folder
    (``cached``: the plan already read from the cache)."""
    main, effective = kind.main, cfg.batch.effective_batch
    resuming = cfg.output.resume is not None
    model = build_model(cfg, recipe, log)
    device = run_device()
    signature = _signature(recipe, model)  # the whole model's, on every process
    model = kind.wrap(model).to(device)
    recipe, data = run_data(cfg, recipe, loaded)
    sched = cfg.schedule
    total_steps = total_samples = None
    if sched.samples is not None or sched.epochs is not None:
        total_samples = sched.samples or max(1, round(sched.epochs * data.epoch_samples()))
    else:
        total_steps = sched.steps
    saved = _resume_from(kind, folder, device, log) if resuming else None
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
    then = saved.get(PROCESSES) if saved is not None else None
    _check_processes(then, cfg, kind, folder.path)
    if main and not resuming:
        folder.write_json(CONFIG, cfg.flat())  # first: a crash is resumable
    if main and loaded is not None:
        save_cache(loaded, folder.path)  # a resume reads the sequences back
    # What the untrained model scores (minilm's probe), once, on rank 0's whole model.
    baseline = _Baseline(folder, data, log, measure=main and not resuming)
    model = kind.distribute(model, lambda m: baseline(m, cfg.batch.micro_batch or 8), log)
    optimizer = build_optimizer(cfg, model)
    # What planning (when it runs here: FSDP2, a GPU) and the baseline's measurement leave
    # resident, training sits on (a first forward's one-time allocations: thread pools,
    # kernels' caches, which a fresh process pays inside its first window): the run's meter
    # counts it, as the plan's fresh process does.
    with Resident(device) as before_training:
        micro_size, checkpointing, sync, eval_micro_size = planning.micro_size(
            cfg, folder, saved, kind, model, optimizer, recipe, device, log, data, cached
        )
        baseline(model, micro_size)
    if (
        cfg.batch.batch_schedule == "auto"
        and micro_size * kind.replicas >= effective
        and saved is None
    ):
        micro_size = max(1, math.ceil(largest_share(effective, kind.replicas) / 2))
        log(
            f"--batch-schedule auto measures the noise scale, which needs 2+ micro-batches "
            f"per window: micro-batch {micro_size}"
        )
    schedule = BatchSchedule(
        cfg.batch.batch_schedule,
        start=effective,
        unit=micro_size * kind.replicas,
        maximum=cfg.batch.max_effective_batch,
    )
    acc = kind.window(cfg, model, optimizer, micro_size, sync, device, log)
    if cfg.numerics.compile:
        recipe = compiled(recipe, model, kind, log)
    # With clipping, a gradient spike's step is already bounded: the loss tells damage.
    guard = IncidentGuard(gradient=not cfg.numerics.max_grad_norm) if cfg.incidents.guard else None
    run = Run(
        cfg=cfg,
        folder=folder,
        kind=kind,
        recipe=recipe,
        model=model,
        device=device,
        data=data,
        optimizer=optimizer,
        acc=acc,
        micro_size=micro_size,
        eval_micro_size=eval_micro_size,
        checkpointing=checkpointing,
        signature=signature,
        progress=Progress(schedule, total_steps, total_samples),
        targets=cfg.targets.runtime(),
        guard=guard,
        carried=before_training.grown,
    )
    if saved is not None:
        try:
            run.restore(saved)
        except ValueError as err:  # the checkpoint's parts do not load: nothing written yet
            raise ValueError(f"--resume {folder.path}: {err}") from None
    if main and resuming:  # recorded once the checkpoint has loaded: a refusal writes nothing
        trained = saved.get("config") if saved else None
        _record_resume(folder, saved_cfg, cfg, saved["step"] if saved else 0, then, kind, log,
                       trained)  # fmt: skip
    if resuming:
        where = f"step {schedule.step} of {total_steps}"
        if total_samples is not None:
            where = f"step {schedule.step}, sample {schedule.samples:,} of {total_samples:,}"
        log(f"resuming {folder.path} at {where} (micro-batch {micro_size})")
    run.progress.skip_ahead()
    return run


def _resume_from(kind: RunKind, folder: RunFolder, device: torch.device, log):
    """The checkpoint a resume continues from: checkpoint.pt, verified; when it is damaged or
    missing, the newest kept checkpoint that is intact, said in one line naming each one
    passed over and the step the run goes back to (the steps after it are trained again,
    exactly); None when the run stopped before its first checkpoint. Every rank tries the
    same files and takes the same one (a rank whose part of a checkpoint is damaged rules
    that checkpoint out for all)."""
    kept = [file for _, file in reversed(Checkpoints(folder).kept())]
    passed: list[str] = []  # what was wrong with each checkpoint passed over, newest first
    for file in [None, *kept]:
        saved, problem = None, None
        try:
            saved = kind.load_saved(folder, device, file)
        except NewerCheckpoint:
            raise  # whole, only too new: nothing to fall back from or to move away
        except ValueError as err:
            problem = str(err)
        if file is None and saved is None and problem is None:
            if not kept:
                return None  # stopped before its first checkpoint: from step 0
            problem = f"{folder.path / CHECKPOINT} is missing"
        told = launch.first_message(problem)
        if told is not None:
            passed.append(told)
            continue
        if passed:
            log(
                f"{'; '.join(passed)}; resuming from {file} instead, the newest intact "
                f"checkpoint (step {saved['step']}): the steps after it are trained again"
            )
        return saved
    raise ValueError(
        "; ".join(passed)
        + ("; no kept checkpoint under checkpoints/ is intact either" if kept else "")
        + ". Restore it, or move it away to resume the run from step 0 with its saved "
        "configuration"
    )


class _Baseline:
    """What the untrained model scores by the recipe's simpler method (a linear probe on the
    pretrained encoder), measured once before training into baseline.json; the summary sets
    the run's result against it. Drawn from no generator the run uses. The recipe may start
    the model from it (minilm's head starts from the probe's): rank 0 alone measures it, on
    the whole model, and DistributedDataParallel (or FSDP2's start) copies rank 0's
    parameters to every rank after this."""

    def __init__(self, folder: RunFolder, data: Any, log, *, measure: bool) -> None:
        self.folder, self.data, self.log = folder, data, log
        self.pending = measure and hasattr(data, "baseline")

    def __call__(self, model: torch.nn.Module, micro_size: int) -> None:
        if not self.pending:
            return
        self.pending = False
        self.log("measuring the baseline before training ...")
        with preserved_rng():
            result = self.data.baseline(model, micro_size)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "name")
        self.log(f"baseline ({result['name']}): held-out {shown}")
        self.folder.write_json(BASELINE, result)


def _constant_schedule_state(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """The schedule's state for a checkpoint written before schedules (gradaccum < 0.3): a
    constant batch, so the position follows from the step."""
    if cfg.batch.batch_schedule != "constant":
        raise ValueError("a checkpoint from before batch schedules resumes with a constant batch")
    step = saved["step"]
    return {
        "spec": "constant",
        "step": step,
        "samples": step * cfg.batch.effective_batch,
        "items": saved["accumulator"]["accumulator"]["items"],
        "current": cfg.batch.effective_batch,
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
    seq_len = cfg.source.seq_len or min(128, encoder.max_len)
    loaded = load_sequences(
        cfg.source.data,
        encoder,
        seq_len=seq_len,
        eval_fraction=cfg.source.eval_fraction,
        seed=cfg.source.seed,
        text_field=cfg.source.text_field,
        cache=Path(cfg.output.resume) if cfg.output.resume else None,
    )
    if cfg.output.resume and not (Path(cfg.output.resume) / f"data-{loaded['key']}.pt").is_file():
        if any(Path(cfg.output.resume).glob("data-*.pt")):
            raise DataError(
                f"--resume {cfg.output.resume}: --data {cfg.source.data} is not the data this "
                "run began with (its files or the tokenizer changed); start a new run with --out"
            )
    sequences = len(loaded["train"][0])
    if sequences < cfg.batch.effective_batch:
        raise DataError(
            f"--data {cfg.source.data}: {sequences} training sequences of {seq_len} tokens, "
            f"fewer than one effective batch ({cfg.batch.effective_batch}); lower "
            "--effective-batch or --seq-len, or add data"
        )
    return loaded


def _check_unchanged(saved: dict[str, Any], cfg: TrainConfig, path: Path) -> None:
    """A resumed run may train longer or report differently; anything else would make it a
    different run recorded as this one. Refuse, naming each change."""
    mine = cfg.flat()
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


def _check_processes(then: int | None, cfg: TrainConfig, kind: RunKind, path: Path) -> None:
    """A resume with another number of processes than its checkpoint's (``then``; a
    checkpoint from before the count was recorded resumes as before) is allowed where every
    window keeps its effective batch exactly: DDP replicas (each holds the whole model and
    its share of the window; the sum over ranks is the same sum, added in another order) and
    a constant batch (a schedule rounds its batches to micro-batch x processes). Anything
    else is refused, with the launch that resumes it as it was. Every rank decides alike."""
    now = kind.world
    if then is None or then == now:
        return
    why = None
    if not kind.resumes_on_any_count:
        why = "its checkpoint is split across its processes (--shard fsdp, --pipeline-stages)"
    elif cfg.batch.batch_schedule != "constant":
        why = (
            f"--batch-schedule {cfg.batch.batch_schedule} rounds its batches to whole "
            "micro-batches on every process, which another count would change"
        )
    if why is not None:
        raise ValueError(
            f"--resume {path}: the run trained with {_processes(then)}, this job has "
            f"{now}; {why}. Resume it with: {launch.resume_command(path, then)}"
        )


def previous_stop(folder: RunFolder) -> str | None:
    """How the session before a resume ended, in a few words: its summary.json's stop, or,
    with no summary written since its checkpoint, that it ended without one (a crash, a
    kill). None for a run that has no record of either."""
    summary, checkpoint = folder.path / SUMMARY, folder.path / CHECKPOINT
    if not summary.is_file():
        return "ended without a summary (killed or crashed)" if checkpoint.is_file() else None
    if checkpoint.is_file() and checkpoint.stat().st_mtime_ns > summary.stat().st_mtime_ns:
        return "ended without a summary (killed or crashed)"
    try:
        stopped = json.loads(summary.read_text()).get("stopped_by")
    except (OSError, ValueError, AttributeError):
        return None
    return {
        "signal": "a stop signal (checkpointed)",
        "length": "its length",
        "guard": "the incident guard",
    }.get(stopped, str(stopped).replace("_", " ") if stopped else "its end")


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _record_resume(
    folder: RunFolder,
    saved: dict[str, Any],
    cfg: TrainConfig,
    start: int,
    then: int | None,
    kind: RunKind,
    log,
    trained: dict[str, Any] | None = None,
) -> None:
    """config.json becomes what the run now trains with; resumes.jsonl says what changed
    (another process count too, said in one line: ``_check_processes`` allowed it), and
    what config.json says that the checkpoint's session did not train with (``trained``: a
    hand edit of the file, said in one line and recorded as ``edited``)."""
    mine = cfg.flat()
    changed = {k: [saved.get(k), mine[k]] for k in RESUMABLE if saved.get(k) != mine[k]}
    line: dict[str, Any] = {"step": start, "changed": changed}
    before = previous_stop(folder)
    if before is not None:  # why the session before this one ended
        line["after"] = before
    edited = {
        k: [trained[k], v]
        for k, v in json.loads(json.dumps(saved, default=str)).items()
        if trained is not None and k in trained and trained[k] != v
    }
    if edited:
        line["edited"] = edited
        said = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in edited.items())
        log(
            f"config.json was edited since the checkpoint of step {start} was written: "
            f"{said}; the run trains with the edit (recorded in {RESUMES})"
        )
    if then is not None and then != kind.world:
        line[PROCESSES] = [then, kind.world]
        log(
            f"resuming with the same effective batch, exact, but not bit for bit: "
            f"{_processes(then)} then, {kind.world} now (the gradient's sum over processes "
            "is added in another order)"
        )
    folder.append_line(RESUMES, line)
    folder.write_json(CONFIG, {**saved, **{k: mine[k] for k in RESUMABLE}})
