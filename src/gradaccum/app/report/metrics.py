"""One table of a run's numbers: each metric's name (its key in metrics.jsonl or
summary.json), the label people read, its unit, and for a step's metric its TensorBoard tag.
The metrics line's TensorBoard scalars, the summary table the run prints and report.html all
read it: a new metric is one line here.

Units: "" (a plain number), "bytes", "seconds", "samples", "items", "changes" (a list of
[step, batch]), "text".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["STEP", "SUMMARY", "Metric", "item_label"]


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    unit: str = ""
    tag: str | None = None  # TensorBoard's (a step's metric)
    printed: bool = True  # in the table the run prints at its end (a summary's metric)
    page: bool = True  # on report.html (False: kept in summary.json, said on neither)


# A line of metrics.jsonl, one per optimizer step (the held-out eval_* keys join it at each
# evaluation, each by its recipe's own name).
STEP = (
    Metric("step", "optimizer step"),
    Metric("samples", "samples seen", "samples"),
    Metric("effective_batch", "effective batch", "samples", "batch/effective_batch"),
    Metric("loss", "train loss, per item", "", "train/loss"),
    Metric("lr", "learning rate", "", "train/lr"),
    Metric("grad_norm", "gradient norm before clipping", "", "train/grad_norm"),
    Metric("count", "items", "items"),
    Metric("micro_batches", "micro-batches", "", "batch/micro_batches"),
    Metric("seconds", "seconds", "seconds"),
    Metric("peak_memory", "peak training memory", "bytes", "memory/peak_mib"),
    Metric("skipped", "why the window was skipped", "text"),
    Metric("oom_replays", "out-of-memory replays", ""),
    Metric("noise_scale", "gradient noise scale B_simple", "items", "noise/b_simple"),
    Metric("noise_low", "B_simple, low end of its interval", "items", "noise/b_simple_low"),
    Metric("noise_high", "B_simple, high end of its interval", "items", "noise/b_simple_high"),
)

# summary.json, in the order the summary table and the report show it (the held-out
# metrics follow the train losses; the baseline, targets and the stop have rows of their own).
SUMMARY = (
    Metric("steps", "optimizer steps"),
    Metric("samples", "samples seen", "samples"),
    Metric("items", "items seen", "items"),
    Metric("effective_batch_final", "effective batch at the end", "samples"),
    Metric("seconds_this_session", "time (this session)", "seconds"),
    Metric("first_loss", "train loss, first step"),
    Metric("final_train_loss", "train loss, mean of the last 10 steps"),
    Metric("peak_memory", "peak training memory", "bytes"),
    Metric("device", "device", "text", printed=False),
    Metric("windows", "windows", printed=False),
    Metric("skipped_windows", "skipped windows"),
    Metric("oom_replays", "out-of-memory replays"),
    Metric("incidents", "incidents"),
    Metric("batch_changes", "effective batch changes", "changes", printed=False),
    Metric("noise_scale", "gradient noise scale B_simple (items)", "items", printed=False),
    Metric("noise_interval", "its 90% interval", "interval", printed=False),
    Metric("noise_advice", "noise scale advice", "text", printed=False),
    # the console says the advice alone; the page says what the console says
    Metric("noise_tradeoff", "the effective batch's trade-off", "text", printed=False, page=False),
)


def item_label(name: str, label: str, summary: dict[str, Any]) -> str:
    """A summary row's label, with the run's own item where the row counts items: "bytes
    seen" for the byte-level GPT, "tokens seen", "images seen" (``summary["item"]``, the
    recipe's); the generic label for a run that did not record its item."""
    item = summary.get("item")
    if name == "items" and isinstance(item, str) and item:
        return f"{item}s seen"
    return label
