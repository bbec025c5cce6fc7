"""The end of a run: summary.json, the plots, report.html and the summary table."""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.app.folder import BASELINE, INCIDENTS, TENSORBOARD
from gradaccum.app.folder import SUMMARY as SUMMARY_JSON
from gradaccum.app.report import plots
from gradaccum.app.report.metrics import SUMMARY, item_label
from gradaccum.app.run import Run
from gradaccum.engine import Accumulator
from gradaccum.memory import format_bytes
from gradaccum.noise import NoiseReading, advise, tradeoff_advice
from gradaccum.planning.result import format_seconds


def report(
    run: Run,
    log,
    seconds: float,
    lines: list[dict[str, Any]],
    last_eval: dict[str, float],
    table: bool = True,
) -> dict[str, Any]:
    """summary.json, the plots and the summary table, from metrics.jsonl's ``lines`` and the
    counters (``last_eval``: the held-out numbers at the last step, ``Evaluator.final``'s)."""
    cfg, acc, out = run.cfg, run.acc, run.folder.path
    progress = run.progress
    if progress.step == progress.start and progress.stopped_by == "length":
        log(f"{out} already trained {progress.length()}; nothing to do")
    summary = _summarize(lines, acc, last_eval, seconds, run.device)
    summary["item"] = run.recipe.item  # what "items" counts: bytes, tokens, images
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
            "noise_advice": noise_advice(
                batch_items, reading, acc.state.items / max(schedule.samples, 1)
            )
            if acc.noise is not None
            else (
                "gradient noise scale: not measured ("
                + (
                    "--no-noise-scale"
                    if not cfg.batch.noise_scale
                    else "a pipeline's stages never hold a micro-batch's whole gradient"
                )
                + ")"
            ),
            "noise_tradeoff": None
            if acc.noise is None
            else tradeoff_advice(batch_items, reading, acc.state.items / max(schedule.samples, 1)),
            "run_folder": str(out),
            "stopped_by": progress.stopped_by,
            "targets": run.targets.summary(),
            "incidents": len(incidents),
        }
    )
    if (out / BASELINE).is_file():
        summary["baseline"] = against_baseline(run.folder.read_json(BASELINE), summary)
    run.folder.write_json(SUMMARY_JSON, summary)
    plots.draw(out, lines, incidents)
    from gradaccum.app.report import write_report

    page = write_report(out, summary=summary, metrics=lines)
    if table:
        log(summary_table(summary))
        if cfg.batch.noise_scale:  # (the trade-off against one sample: summary.json)
            log(summary["noise_advice"])
        log(f"\nthe run's page: {page} (open it in a browser)")
        if (out / TENSORBOARD).is_dir():
            log(f"its curves in TensorBoard: tensorboard --logdir {out / TENSORBOARD}")
    return summary


def noise_advice(batch_items: float, reading: NoiseReading | None, items_per_sample: float) -> str:
    """The library's advice (``gradaccum.noise.advise``) in the command's terms: the
    measurement, then the advice with the batch it names as the flag to give."""
    found = advise(batch_items, reading, items_per_sample)
    said = found.sentence(lambda n: f"--effective-batch {n}")
    return found.measurement() if said is None else f"{found.measurement()}\n{said}"


def against_baseline(baseline: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The baseline's numbers beside the run's held-out ones, with the margin of each."""
    out = dict(baseline)
    for metric, value in baseline.items():
        mine = summary.get(f"held_out_{metric}")
        if metric != "name" and isinstance(mine, (int, float)):
            out[f"{metric}_margin"] = mine - value
    return out


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


def summary_table(s: dict[str, Any]) -> str:
    def fmt(v: Any, unit: str = "") -> str:
        if unit == "bytes":
            return format_bytes(v)
        if unit == "seconds":
            return format_seconds(v)  # as the report writes it
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"  # 1,219,200 items, as the step lines count them
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    rows = []
    for m in SUMMARY:  # the metrics table's printed rows, in its order
        if not m.printed or m.name == "final_train_loss":
            continue
        if m.name == "first_loss":  # one row for the two train losses, the held-out after
            rows.append(
                (
                    "train loss (first -> last 10 steps)",
                    f"{fmt(s['first_loss'])} -> {fmt(s['final_train_loss'])}",
                )
            )
            rows += [
                (k.replace("_", " "), fmt(v)) for k, v in s.items() if k.startswith("held_out")
            ]
            rows += baseline_rows(s.get("baseline"))
            continue
        rows.append((item_label(m.name, m.label, s), fmt(s[m.name], m.unit)))
    rows += [
        ("stopped by", _STOPPED[s["stopped_by"]]),
        *[
            (name.replace("_", " "), _target_text(name, t))
            for name, t in s["targets"].items()
            if t["status"] != "not set"
        ],
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "summary", "-" * (width + 24)] + [f"{k:<{width}}  {v}" for k, v in rows])


def baseline_rows(baseline: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not baseline:
        return []
    return [
        (f"baseline {metric}", f"{value:.4f} ({baseline['name']}); this run {margin:+.4f}")
        for metric, value in baseline.items()
        if (margin := baseline.get(f"{metric}_margin")) is not None
    ]


_STOPPED = {
    "length": "its length (trained all it was asked)",
    "target_loss": "--target-loss met",
    "target_accuracy": "--target-accuracy met",
    "max_time": "--max-time reached",
    "max_memory": "--max-memory reached",
    "guard": "the incident guard (see incidents.jsonl)",
    "signal": "a signal or a closed output pipe (checkpointed; --resume continues)",
}


def _target_text(name: str, t: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        if v is None:
            return "-"
        if name == "max_memory":
            return format_bytes(v)
        if name == "max_time":
            return format_seconds(v)
        return f"{v:.4g}"

    when = f" at step {t['step']}" if t["step"] is not None else ""
    return f"{t['status']}{when} (limit {show(t['limit'])}, observed {show(t['value'])})"
