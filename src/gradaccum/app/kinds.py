"""The kinds of run: one process or DDP replicas, FSDP2 shards, pipeline stages.

Each kind is a class with the small interface the build, the loop and the report use: the
job it needs, this process's part of the model, how the model is spread over the processes,
how the micro-batch is planned, the window runner, how the batch reaches this process, how
one window runs, what a checkpoint holds of this process's part and how it is restored,
which module evaluates, and how the whole model is gathered at the end. Nobody else asks
which kind a run is: what differs between kinds lives here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gradaccum.app import launch, planning
from gradaccum.app.checkpoints import Checkpoints, read_sealed, sealed
from gradaccum.app.folder import SHARDS, STAGES, RunFolder, write_failure
from gradaccum.batching import shard, split
from gradaccum.engine import Accumulator
from gradaccum.noise import NoiseScale
from gradaccum.oom import OOMReplay
from gradaccum.window import StepResult

__all__ = ["Pipelined", "Replicated", "RunKind", "Sharded"]


class RunKind:
    """The interface, with what one process and DDP do (``Replicated``): each rank trains a
    share of the batch through an Accumulator, rank 0 alone evaluates and writes."""

    #: every rank takes part in each forward, evaluation included (a pipeline's stages, or
    #: FSDP2's ranks gathering each block's parameters)
    together = False
    #: the model is held in parts that ``gather`` joins into a whole state_dict (FSDP2)
    gathers = False
    #: a resume may run on another number of processes (each holds the whole model and its
    #: checkpoint is whole in checkpoint.pt): not when the checkpoint is split by process
    resumes_on_any_count = True

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    @staticmethod
    def of(cfg: Any, rank: int, world: int) -> RunKind:
        """The kind of run the configuration makes, checked against the job (a ValueError
        saying how to launch it when the job does not fit)."""
        if cfg.distributed.pipeline_stages > 1:
            return Pipelined(rank, world, cfg.distributed)
        if cfg.distributed.shard == "fsdp":
            return Sharded(rank, world)
        return Replicated(rank, world)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """This process's part of the model (before it moves to its device)."""
        return model

    def distribute(self, model: torch.nn.Module, before: Any, log) -> torch.nn.Module:
        """The model as the processes hold it (the optimizer is made over its parameters
        after this). ``before(model)`` runs first where the whole model must be seen before
        it is spread (minilm's baseline); a kind that keeps the model whole leaves it for
        later."""
        return model

    def cached(self, cfg: Any, device: torch.device, log) -> dict[str, Any] | None:
        """Rank 0's plan from the cache before the model is built (``plan``'s ``cached``),
        or None: none stored, another rank, or a kind whose ranks plan together."""
        return planning.cached_plan(cfg, device, self.world, log) if self.main else None

    def plan(
        self, cfg: Any, model, optimizer, recipe, device, log, data=None, cached=None
    ) -> dict[str, Any]:
        """A new plan (plan.json's record): rank 0 plans, every rank takes its plan. With
        the run's ``data``, the plan covers its evaluations, checkpoints and exports too.
        ``cached``: rank 0's plan already read from the cache (``cached``)."""
        return planning.window_plan(
            cfg, model, optimizer, recipe, device, self.rank, self.world, log,
            each_rank=False, data=data, cached=cached,
        )  # fmt: skip

    def window(self, cfg: Any, model, optimizer, micro_size: int, sync: str, device, log) -> Any:
        """The window runner: an Accumulator over the model, DDP's copy on several ranks.
        Under DDP the ranks replay an out-of-memory window together, at the price of the
        window's reduction no longer overlapping its last backward: worth it where memory
        runs out (CUDA)."""
        train_model = model
        if self.replicas > 1:
            from torch.nn.parallel import DistributedDataParallel

            train_model = DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None
            )
        replay = self.world == 1 or device.type == "cuda"
        return _accumulator(cfg, train_model, optimizer, sync, replay)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Processes that each train a share of the batch."""
        return self.world

    def across(self, cfg: Any) -> str:
        """How the window is spread, for the run's first line ("" in one process)."""
        return f" on each of {self.replicas} processes" if self.replicas > 1 else ""

    def local(self, batch: Any) -> Any:
        """This process's part of the window's batch."""
        return shard(batch, self.rank, self.replicas) if self.replicas > 1 else batch

    def step(self, acc: Any, batch: Any, micro_size: int, loss_fn: Any) -> StepResult:
        """One window: the batch cut into micro-batches of ``micro_size``, one optimizer
        step."""
        return acc.step(split(batch, micro_size), loss_fn)

    def agree(self, value: Any) -> Any:
        """Rank 0's value on the ranks that act on it together (all of them when together;
        else rank 0 alone acts, and its own value is what counts)."""
        return launch.broadcast(value) if self.together else value

    def evaluates(self) -> bool:
        """Whether this process runs the held-out evaluation."""
        return self.main or self.together

    def evaluated(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module that evaluates: the model as trained."""
        return model

    def sync_mode(self, acc: Any) -> str:
        """The gradient sync a checkpoint records (a resume keeps it)."""
        return acc.sync.mode

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        """This process's part of step ``step``'s checkpoint, written where it belongs, before
        rank 0 commits checkpoint.pt. Returns what checkpoint.pt holds as ``accumulator``
        (None: rank 0's ``acc.state_dict()``). Raises ValueError, on every rank alike, when a
        part could not be written."""
        return None

    def load_saved(
        self, folder: RunFolder, device: torch.device, file: Path | None = None
    ) -> dict[str, Any] | None:
        """The run's checkpoint (checkpoint.pt, or a kept ``file``), with this process's part
        in ``accumulator``."""
        return Checkpoints(folder).load(device, file)

    def restore(self, acc: Any, folder: RunFolder, state: Any) -> None:
        """``acc`` as the checkpoint's ``accumulator`` (``load_saved``'s) left it."""
        acc.load_state_dict(state)

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        """After a commit: the parts of steps no checkpoint names any more."""

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, when this process does not hold it whole (every
        rank takes part); None when the model is whole here already."""
        return None


class Replicated(RunKind):
    """One process, or DDP: every rank holds the whole model (``RunKind``'s behaviour)."""


class Sharded(RunKind):
    """FSDP2 (``--shard fsdp``): each rank holds shards of the model and the optimizer. The
    ranks write their shards together through torch.distributed.checkpoint and rank 0's
    checkpoint.pt names the folder; the whole model is gathered at the end."""

    together = True
    gathers = True
    resumes_on_any_count = False

    def __init__(self, rank: int, world: int) -> None:
        if world < 2:
            raise ValueError(
                "--shard fsdp shards the model over torchrun's processes and this job has one: "
                "launch it with torchrun --nproc-per-node N (N >= 2)"
            )
        super().__init__(rank, world)

    def distribute(self, model, before, log):
        """The baseline first, on rank 0's whole model; sharding then starts every rank from
        rank 0's parameters."""
        before(model)
        return _fully_shard(model, log)

    def cached(self, cfg, device, log):
        return None  # every rank plans its own shards, together

    def plan(self, cfg, model, optimizer, recipe, device, log, data=None, cached=None):
        return planning.window_plan(
            cfg, model, optimizer, recipe, device, self.rank, self.world, log, each_rank=True
        )

    def window(self, cfg, model, optimizer, micro_size, sync, device, log):
        return _accumulator(cfg, model, optimizer, sync, replay=False)

    # Every rank writes its part of step N's checkpoint into shards/step-N.tmp/; when all
    # have, rank 0 renames it shards/step-N/ and writes checkpoint.pt naming it (the commit).
    # A crash before the commit leaves the previous checkpoint and the folder it names.

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        tmp = folder.path / SHARDS / f"step-{step:08d}.tmp"
        problem = _fresh_folder(tmp) if self.main else None
        if not launch.any_rank(problem is not None):
            try:
                _save_shards(acc, tmp)
            except ValueError as err:
                problem = str(err)
        problem = launch.first_message(problem)  # the failing rank's own words, on every rank
        if problem is not None:
            raise ValueError(problem)
        if not self.main:
            return {"shards": None}
        name = _commit_shards(folder, step)
        return {"shards": name, "files": _shard_digests(folder.path / name)}

    def load_saved(
        self, folder: RunFolder, device: torch.device, file: Path | None = None
    ) -> dict[str, Any] | None:
        """checkpoint.pt, and the shard folder it names checked against its checksums by
        rank 0 before any rank reads it (DCP reads collectively: all or none)."""
        saved = Checkpoints(folder).load(device, file)
        problem = None
        if saved is not None and self.main:
            part = saved["accumulator"]
            problem = _check_shards(folder.path / part["shards"], part.get("files"))
        problem = launch.broadcast(problem)
        if problem is not None:
            raise ValueError(problem)
        return saved

    def restore(self, acc: Any, folder: RunFolder, state: Any) -> None:
        """Every rank: its shards and state of the checkpoint's folder."""
        from gradaccum.checkpoint import load_sharded

        path = folder.path / state["shards"]
        if not path.is_dir():
            raise ValueError(
                f"{path} is missing: the checkpoint needs every rank's shards; restore it, "
                "or start a new run"
            )
        load_sharded(acc, path)

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        """The shard folders of steps no checkpoint names, and those a crash left
        half-written."""
        for part in (folder.path / SHARDS).glob("step-*"):
            try:
                step = int(part.name[5:])
            except ValueError:  # step-N.tmp: never committed
                step = None
            if step not in keep_steps:
                shutil.rmtree(part, ignore_errors=True)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)


class Pipelined(RunKind):
    """Pipeline stages (``--pipeline-stages``), one per process, sharing one batch: the
    schedule cuts it into the window's micro-batches. Stage S > 0 writes its own part of each
    checkpoint; evaluation chains the stages."""

    together = True
    resumes_on_any_count = False

    def __init__(self, rank: int, world: int, distributed: Any) -> None:
        stages = distributed.pipeline_stages
        if world != stages:
            raise ValueError(
                f"--pipeline-stages {stages} runs one stage per process: launch it with "
                f"torchrun --nproc-per-node {stages} (this job has {world} "
                f"process{'es' * (world > 1)}; pipeline replicas under data parallelism are "
                "not built yet)"
            )
        super().__init__(rank, world)
        self.schedule = distributed.pipeline_schedule
        self.chained: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """This stage's blocks; the rest of the model is dropped."""
        from gradaccum.app.recipes.gpt import GPTStage
        from gradaccum.pipeline import ChainedStages

        stage = GPTStage(model, self.rank, self.world)
        self.chained = ChainedStages(stage)
        return stage

    def cached(self, cfg, device, log):
        return None  # the stages' plan is made from the stages themselves

    def plan(self, cfg, model, optimizer, recipe, device, log, data=None, cached=None):
        return planning.pipeline_plan(cfg, model, log)

    def window(self, cfg, model, optimizer, micro_size, sync, device, log):
        """This stage's ``PipelineWindow``: its part of the model as a ``PipelineStage``, the
        window's micro-batches of ``micro_size``, the tied head's copies kept equal."""
        from torch.distributed.pipelining import PipelineStage

        from gradaccum.loss import causal_lm_loss
        from gradaccum.pipeline import PipelineWindow

        if cfg.batch.noise_scale:
            log(
                "the noise scale is not measured through a pipeline: the schedule runs the "
                "window's micro-batches inside one call, so their separate gradients are not seen"
            )
        return PipelineWindow(
            PipelineStage(model, self.rank, self.world, device),
            optimizer,
            causal_lm_loss,
            cfg.batch.effective_batch // micro_size,
            schedule=self.schedule,
            max_grad_norm=cfg.numerics.max_grad_norm or None,
            tied=model.tied(),
            precision=cfg.numerics.precision,
        )

    @property
    def replicas(self) -> int:
        return 1  # pipeline replicas under data parallelism are not built

    def across(self, cfg: Any) -> str:
        return f" through {self.world} pipeline stages ({self.schedule})"

    def step(self, acc: Any, batch: Any, micro_size: int, loss_fn: Any) -> StepResult:
        return acc.step(batch["input_ids"], target=batch["labels"])

    def evaluated(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.chained

    def sync_mode(self, acc: Any) -> str:
        return "window"

    # Stage S > 0 writes its part of step N's checkpoint as stages/stage-S-step-N.pt before
    # rank 0 writes checkpoint.pt (the commit); a crash between them leaves the previous
    # step's files, which the previous checkpoint.pt names. Files of steps no checkpoint
    # names any more are removed after the commit.

    def save_parts(self, acc: Any, folder: RunFolder, step: int) -> dict[str, Any] | None:
        problem = None
        if not self.main:
            state = {"step": step, "accumulator": acc.state_dict()}
            try:
                try:
                    (folder.path / STAGES).mkdir(exist_ok=True)
                except OSError as err:
                    raise ValueError(
                        f"cannot write {folder.path / STAGES}: {write_failure(err)}"
                    ) from None
                name = f"{STAGES}/{_stage_file(self.rank, step)}"
                folder.write_file(name, lambda tmp: torch.save(sealed(state), tmp))
            except ValueError as err:
                problem = str(err)
        problem = launch.first_message(problem)  # every stage's part, or no commit
        if problem is not None:
            raise ValueError(problem)
        return None

    def load_saved(
        self, folder: RunFolder, device: torch.device, file: Path | None = None
    ) -> dict[str, Any] | None:
        saved = Checkpoints(folder).load(device, file)
        if saved is not None and not self.main:
            part = folder.path / STAGES / _stage_file(self.rank, saved["step"])
            if not part.exists():
                raise ValueError(
                    f"{part} is missing: the checkpoint of step {saved['step']} needs every "
                    "stage's part; restore it, or start a new run"
                )
            saved["accumulator"] = read_sealed(part, device)["accumulator"]
        return saved

    def prune(self, folder: RunFolder, keep_steps: set[int]) -> None:
        for file in (folder.path / STAGES).glob("stage-*-step-*.pt"):
            try:
                step = int(file.stem.rsplit("-", 1)[1])
            except ValueError:
                continue
            if step not in keep_steps:
                file.unlink(missing_ok=True)


def _accumulator(cfg: Any, model, optimizer, sync: str, replay: bool) -> Accumulator:
    return Accumulator(
        model,
        optimizer,
        max_grad_norm=cfg.numerics.max_grad_norm or None,
        precision=cfg.numerics.precision,
        oom=OOMReplay() if replay else None,
        noise=NoiseScale() if cfg.batch.noise_scale else None,
        sync=sync,
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


def _stage_file(stage: int, step: int) -> str:
    return f"stage-{stage}-step-{step:08d}.pt"


def _fresh_folder(tmp: Path) -> str | None:
    """Rank 0, before the ranks write a step's shards: an empty folder for them (what a crash
    left there is removed). A problem is returned, not raised: every rank must hear of it
    before any of them writes."""
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as err:
        return f"cannot write {tmp}: {write_failure(err)}"
    return None


def _save_shards(acc: Any, tmp: Path) -> None:
    """This rank's shards and state into ``tmp`` (every rank calls it: torch.distributed.
    checkpoint is collective)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from gradaccum.checkpoint import save_sharded

    try:
        save_sharded(acc, tmp)
    except (OSError, RuntimeError, CheckpointException) as err:
        raise ValueError(f"cannot write {tmp}: {write_failure(err)}") from None


def _commit_shards(folder: RunFolder, step: int) -> str:
    """Rank 0, after every rank wrote: the folder renamed to its final name, which
    checkpoint.pt will hold (relative to the run folder)."""
    name = f"{SHARDS}/step-{step:08d}"
    final = folder.path / name
    try:
        shutil.rmtree(final, ignore_errors=True)  # a rollback's earlier branch
        os.replace(final.with_name(final.name + ".tmp"), final)
    except OSError as err:
        raise ValueError(f"cannot write {final}: {write_failure(err)}") from None
    return name


def _shard_digests(folder: Path) -> dict[str, str]:
    """Rank 0, after the commit: the checksum of every file in a checkpoint's shard folder
    (every rank's DCP files and rank-R.pt), for checkpoint.pt to hold."""
    from gradaccum.checkpoint import file_digest

    try:
        return {
            str(f.relative_to(folder)): file_digest(f)
            for f in sorted(folder.rglob("*"))
            if f.is_file()
        }
    except OSError as err:
        raise ValueError(f"cannot read {folder}: {write_failure(err)}") from None


def _check_shards(folder: Path, digests: dict[str, str] | None) -> str | None:
    """What is wrong with a checkpoint's shard folder against the checksums written with it
    (None: whole, or a checkpoint from before checksums)."""
    from gradaccum.checkpoint import file_digest

    if not folder.is_dir():
        return (
            f"{folder} is missing: the checkpoint needs every rank's shards; restore it, "
            "or start a new run"
        )
    if digests is None:
        return None
    for rel, recorded in digests.items():
        file = folder / rel
        try:
            whole = file_digest(file) == recorded
        except OSError:
            return f"{file} is missing or unreadable: the checkpoint needs every rank's part"
        if not whole:
            return f"{file} is damaged: its bytes do not match the checksum written with it"
    return None
