"""TensorBoard event files for a run, written beside metrics.jsonl (which stays the record).

One point per optimizer step for each scalar the metrics line defines: the train loss, the
learning rate, the gradient norm before clipping and the clip ratio (the factor clipping
multiplied the gradient by: 1 when it did not clip), the effective batch in samples and in
micro-batches, items per second, peak training memory, the run's skipped windows and
out-of-memory replays so far, B_simple and its interval once the noise scale gives a reading,
and the held-out metrics at each evaluation. Needs the ``tensorboard`` package (``pip install
'gradaccum[tensorboard]'``); torch.utils.tensorboard writes the files.

A resumed or rolled-back run opens its writer with ``purge_step`` at the step after its
checkpoint: TensorBoard's readers then drop the earlier session's points from there on, so
no step is shown twice, as metrics.jsonl is cut back.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from gradaccum.app.folder import TENSORBOARD
from gradaccum.app.report.metrics import STEP

__all__ = ["EventLog", "available", "scalars"]


def available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def scalars(line: dict[str, Any], max_grad_norm: float | None, totals: Any) -> dict[str, float]:
    """The tags and values of one metrics line; ``totals`` is the run's counters so far
    (the Accumulator's state: skipped windows and OOM replays)."""
    out = {}
    for metric in STEP:  # the metrics table's per-step numbers that have a tag
        value = line.get(metric.name)
        if metric.tag is None or value is None or not math.isfinite(value):
            continue
        out[metric.tag] = value / 2**20 if metric.unit == "bytes" else value  # bytes in MiB
    # What follows from the line and the run's counters rather than being in the line:
    out["speed/items_per_second"] = line["count"] / max(line["seconds"], 1e-9)
    out["health/skipped_windows"] = totals.skipped_windows
    out["health/oom_replays"] = totals.oom_replays
    if "train/grad_norm" in out:
        norm = out["train/grad_norm"]
        clip = 1.0 if not max_grad_norm or norm <= max_grad_norm else max_grad_norm / norm
        out["train/clip_ratio"] = clip
    for key, value in line.items():
        if key.startswith("eval_") and value is not None:
            out[f"eval/{key[5:]}"] = value
    return out


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread of its own, which re-raises a failed write (a full
    disk) both there, where Python prints its traceback, and at the next flush here, where
    ``EventLog.write`` says it in one line. Its thread's copy is not printed."""
    previous = threading.excepthook
    if getattr(previous, "gradaccum", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.gradaccum = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class EventLog:
    """A SummaryWriter on ``folder/tensorboard``, from ``start + 1`` on. A write that fails
    is a ValueError naming the folder; the log is then closed for good."""

    def __init__(self, folder: Path, start: int, max_grad_norm: float | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.path = Path(folder) / TENSORBOARD
        self.max_grad_norm = max_grad_norm
        self._writer = SummaryWriter(str(self.path), purge_step=start + 1 if start else None)
        self._failed = False

    def restart(self, start: int) -> None:
        """Continue from ``start`` (a rollback): later points of this file are dropped."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(str(self.path), purge_step=start + 1)

    def write(self, line: dict[str, Any], totals: Any) -> None:
        try:
            for tag, value in scalars(line, self.max_grad_norm, totals).items():
                self._writer.add_scalar(tag, value, line["step"])
            self._writer.flush()
        except Exception as err:  # the writer thread's error, re-raised: OSError and others
            self._failed = True
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise ValueError(f"cannot write {self.path}: {reason}") from None

    def close(self) -> None:
        if self._failed:
            return  # closing would raise the same failure again
        self._writer.close()
