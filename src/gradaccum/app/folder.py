"""The run folder: one training run's files, and every decision about them.

    config.json     the configuration the run trains with (rewritten when a resume changes it)
    plan.json       the plan (or the micro-batch given), written once, never replaced
    resumes.jsonl   one line per resume: the step it resumed at and what it changed
    metrics.jsonl   one line per optimizer step, cut back to the checkpoint's step on resume
    checkpoint.pt   at window boundaries (torch.load(..., weights_only=True)), written atomically,
                    with the SHA-256 of everything in it, verified on load
    checkpoints/    with the incident guard: copies of the last K checkpoints, step-N.pt, to
                    roll back to, and for a resume to fall back on
    stages/         a pipeline's later stages: stage-S-step-N.pt, each stage's part of the
                    checkpoint of step N (checkpoint.pt holds the first stage's)
    shards/         under FSDP2 (--shard fsdp): step-N/, every rank's shards of step N's
                    model and optimizer (torch.distributed.checkpoint) and each rank's own
                    state (rank-R.pt); checkpoint.pt names the folder
    model.pt        under FSDP2, the whole model's state_dict at the end, for use elsewhere
    incidents.jsonl one line per incident the guard found: what it saw and what it did
    baseline.json   a recipe's baseline (minilm: the linear probe), measured before training
    tensorboard/    TensorBoard event files (when the tensorboard package is installed)
    summary.json, loss.png, memory.png, batch.png, report.html    the report at the end
    third_party.log what other packages said that is not about the run (process.ThirdParties)
    .lock           held while a process trains here

A folder is new (missing or empty), a run (it holds config.json), or something else, which
is refused rather than mixed with. A run resumes from its checkpoint, or from step 0 with its
saved configuration and plan when it crashed before the first checkpoint. Every file is
written whole (a temporary file, then a rename), so a crash at any moment leaves the previous
version; metrics.jsonl, appended line by line, is cut back on resume to the steps the
checkpoint holds, so no step is ever recorded twice. Every problem is one ValueError naming
the file and what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["RunFolder", "write_failure"]

# Every file name of a run folder, here and nowhere else.
CONFIG, PLAN, RESUMES = "config.json", "plan.json", "resumes.jsonl"
METRICS, CHECKPOINT, LOCK = "metrics.jsonl", "checkpoint.pt", ".lock"
MEMORY = "memory.json"  # the last session's peak memory, phase by phase
KEPT, INCIDENTS, STAGES = "checkpoints", "incidents.jsonl", "stages"
SHARDS, MODEL = "shards", "model.pt"
BASELINE, SUMMARY = "baseline.json", "summary.json"
TENSORBOARD, EXPORT = "tensorboard", "export"
REPORT = "report.html"
THIRD_PARTY = "third_party.log"  # what other packages said, kept off the terminal
LOSS_PLOT, MEMORY_PLOT, BATCH_PLOT = "loss.png", "memory.png", "batch.png"


class RunFolder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None
        self.made = False  # this process made the folder: a failed start removes it
        self._ours = False  # it was empty or a start that never trained: abandon clears it

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # -- deciding what the folder is --------------------------------------------------------

    def holds_run(self) -> bool:
        return (self.path / CONFIG).is_file()

    def check_usable(self, resume: bool) -> None:
        """Refuse a path that is not a folder, a run when not resuming (unless it never
        trained a step: ``open`` starts afresh in that), anything else that is not empty (but
        for what a killed start leaves: the lock and half-written .tmp files), and no run
        when resuming: each in one line saying what to do."""
        where = f"--resume {self.path}" if resume else f"run folder {self.path}"
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"{where} is a file, not a folder; choose a folder for the run")
        if resume:
            if not self.holds_run():
                raise ValueError(f"{where}: no run there (no {CONFIG})")
            return
        if self.holds_run():
            if self.trained():
                raise ValueError(
                    f"{where} already holds a run; continue it with --resume {self.path} or "
                    "choose another --out"
                )
            return
        names = sorted(p.name for p in self._entries() if not _leftover(p.name))
        if names:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ValueError(
                f"{where} holds files that are not a gradaccum run ({shown}); choose an empty "
                "or new folder"
            )

    def trained(self) -> bool:
        """Whether the run here trained a step: a metrics line, or a checkpoint of a step
        after 0 (the guard's step-0 checkpoint, written before training, is not one)."""
        try:
            if (self.path / METRICS).stat().st_size > 0:
                return True
        except FileNotFoundError:
            pass
        steps = {step for step, _ in self.kept_checkpoints()}
        return bool(steps - {0}) or ((self.path / CHECKPOINT).exists() and 0 not in steps)

    def _entries(self) -> list[Path]:
        return list(self.path.iterdir()) if self.path.is_dir() else []

    def open(self, *, resume: bool, log) -> None:
        """The folder decided and locked for this process, before anything is written in
        it: made if new (``abandon`` then removes it again), locked first (a second process
        is told another one trains there, whatever the folder holds), then checked
        (``check_usable``). A run that never trained a step (a start that failed or was
        killed) is cleared for a new start in the same folder, said in one line; a resume
        leaves every file as it is."""
        if self.path.exists() and not self.path.is_dir() or resume:
            self.check_usable(resume=resume)  # a file, or no run to resume: nothing made
        self.made = not self.path.exists()
        lock_made = not (self.path / LOCK).exists()
        self.create(resume=resume)
        try:
            self.check_usable(resume=resume)
        except BaseException:
            if self.made:
                shutil.rmtree(self.path, ignore_errors=True)
            elif lock_made:  # someone else's folder: leave it as it was
                (self.path / LOCK).unlink(missing_ok=True)
            self.release()
            raise
        self._ours = not resume  # empty, or a start that never trained: abandon may clear it
        if not resume and self.holds_run():
            gone = sorted(p.name for p in self._entries() if p.name != LOCK)
            log(
                f"{self.path} holds a start that never trained a step ({', '.join(gone)}): "
                "starting afresh in it"
            )
            self.clear()

    def clear(self) -> None:
        """Remove everything in the folder but its lock."""
        for entry in self._entries():
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def removable(self) -> bool:
        """Whether ``abandon`` would remove what this start wrote (it trained no step)."""
        return self._ours and not self.trained()

    def abandon(self) -> None:
        """After a start failed before its first step: nothing left that would refuse the
        same command (the folder removed if this process made it, emptied if it was empty
        or a start that never trained; a resumed run's files kept), and the lock released."""
        try:
            if not self.removable():
                return
            if self.made:
                shutil.rmtree(self.path, ignore_errors=True)
            else:
                self.clear()
                (self.path / LOCK).unlink(missing_ok=True)
        except OSError:
            pass  # what is left is a start's files: the next start clears them
        finally:
            self.release()

    def create(self, *, resume: bool = False) -> None:
        """Make the folder (if new) and take its lock: one training process per folder. A
        folder that exists but cannot be written is said as such (not "cannot create")."""
        existed = self.path.is_dir()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if not existed:
                raise ValueError(
                    f"cannot create run folder {self.path}: {write_failure(err)}"
                ) from None
            where = f"--resume {self.path}" if resume else f"run folder {self.path}"
            other = "" if resume else ", or choose another --out"
            raise ValueError(
                f"{where} exists but cannot be written ({write_failure(err)}: gradaccum "
                f"creates {LOCK} and the run's files in it); make it writable{other}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"another process is training in {self.path} (it holds {self.path / LOCK}); "
                "wait for it, or choose another --out"
            ) from None
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            self._lock_fd = None

    # -- files --------------------------------------------------------------------------------

    def read_json(self, name: str, *, needs: tuple[str, ...] = ()) -> Any:
        """A JSON file of the folder; with ``needs``, a table holding those keys (a run's
        config.json and plan.json), else a ValueError naming the file."""
        file = self.path / name
        try:
            text = file.read_text()
            if text.startswith("\ufeff"):  # an editor's byte-order mark: not damage
                raise ValueError(
                    f"{file} starts with a byte-order mark (BOM, as some Windows editors save "
                    "UTF-8), which gradaccum's JSON reader refuses: save it as UTF-8 without a BOM"
                )
            value = json.loads(text)
        except OSError as err:
            raise ValueError(f"cannot read {file}: {write_failure(err)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            where = f" ({err.msg} at line {err.lineno})" if hasattr(err, "lineno") else ""
            raise ValueError(
                f"{file} is not valid JSON{where}; it was damaged outside gradaccum: restore "
                "it, or start a new run"
            ) from None
        if needs:
            missing = [k for k in needs if not isinstance(value, dict) or k not in value]
            if missing:
                held = f"{type(value).__name__} {json.dumps(value)[:40]}"
                raise ValueError(
                    f"{file} holds a {held}, not a table with {', '.join(missing)}; it was "
                    "damaged outside gradaccum: restore it, or start a new run"
                )
        return value

    def write_json(self, name: str, obj: Any) -> None:
        self.write_file(name, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, default=str)))

    def append_line(self, name: str, obj: Any) -> None:
        file = self.path / name
        try:
            with file.open("a") as f:
                f.write(json.dumps(obj, default=str) + "\n")
        except OSError as err:
            raise ValueError(f"cannot write {file}: {write_failure(err)}") from None

    def write_file(self, name: str, write) -> None:
        """``write(tmp)`` writes the file ``name`` whole: to a temporary file, then renamed
        over it. A failure is a ValueError naming the file and why."""
        file = self.path / name
        tmp = file.with_name(file.name + ".tmp")
        try:
            write(tmp)
            os.replace(tmp, file)  # a crash mid-write leaves the previous version whole
        except (OSError, RuntimeError) as err:  # torch.save's writer raises RuntimeError
            with contextlib.suppress(OSError):  # (a read-only folder refuses this too)
                tmp.unlink(missing_ok=True)
            raise ValueError(f"cannot write {file}: {write_failure(err)}") from None

    def kept_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, file) of the kept checkpoints under checkpoints/, oldest first (their
        writing and reading: gradaccum.app.checkpoints)."""
        found = []
        for file in (self.path / KEPT).glob("step-*.pt"):
            try:
                found.append((int(file.stem[5:]), file))
            except ValueError:
                continue
        return sorted(found)

    # -- metrics ------------------------------------------------------------------------------

    def open_metrics(self, through_step: int):
        """metrics.jsonl cut back to the steps up to ``through_step`` (a crash may have left
        later steps, or half a line), then opened for appending."""
        file = self.path / METRICS
        kept = [raw for step, raw in self._metric_lines() if step <= through_step]
        self.write_file(METRICS, lambda tmp: tmp.write_text("".join(x + "\n" for x in kept)))
        try:
            return file.open("a")
        except OSError as err:
            raise ValueError(f"cannot write {file}: {write_failure(err)}") from None

    def check_resumable(self) -> None:
        """Before a resume writes anything: the side files it will read again are whole
        (plan.json, metrics.jsonl), else a ValueError naming the file (and the line)."""
        if (self.path / PLAN).is_file():
            self.read_json(PLAN, needs=("micro_size", "checkpointing"))
        self._metric_lines()

    def _metric_lines(self) -> list[tuple[int, str]]:
        """(step, raw line) of metrics.jsonl; a damaged line is a ValueError naming it, but
        for the half line a crash can leave at the end, which is dropped."""
        file = self.path / METRICS
        if not file.exists():
            return []
        try:
            raws = file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(
                f"cannot read {file} ({getattr(err, 'strerror', None) or 'not text'}); "
                "restore it, or start a new run"
            ) from None
        out = []
        for number, raw in enumerate(raws, 1):
            try:
                line = json.loads(raw)
                step = line["step"] if isinstance(line, dict) else None
            except (json.JSONDecodeError, KeyError):
                step = None
            if isinstance(step, int) and not isinstance(step, bool):
                out.append((step, raw))
            elif number < len(raws):
                raise ValueError(
                    f"{file} line {number} is damaged ({raw[:40]!r}): a step's record would "
                    "be lost; restore the file, or delete that line to resume without it"
                )
        return out

    def metrics(self) -> list[dict[str, Any]]:
        return self.lines(METRICS)

    def lines(self, name: str) -> list[dict[str, Any]]:
        """A .jsonl file's objects; none when it does not exist."""
        file = self.path / name
        if not file.exists():
            return []
        return [json.loads(x) for x in file.read_text().splitlines() if x.strip()]


def _leftover(name: str) -> bool:
    """What a killed start can leave in a folder it made: the lock, half-written files."""
    return name == LOCK or name.endswith(".tmp")


def write_failure(err: Exception) -> str:
    """Why a write failed, in words (OSError's reason, or torch.save's lost one)."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    # torch.save's zip writer loses the system's reason ("unexpected pos ..."): a write that
    # stops short is a full disk or a file size limit.
    return "the write stopped short (is the disk full, or a file size limit reached?)"
