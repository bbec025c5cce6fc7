"""The run report: one self-contained HTML page about a run folder.

``render(run_dir)`` reads what the run folder holds (config.json, plan.json, metrics.jsonl,
summary.json, incidents.jsonl, resumes.jsonl and the plots) and returns the page;
``write_report(run_dir, out=None)`` writes it to RUN_DIR/report.html, or to ``out``.

The page needs nothing but itself: inline CSS, no script, the plots embedded as data: URIs,
and a Content-Security-Policy that forbids every fetch, so it reads the same from a mail
attachment or an archive as from the run folder. Every string from the files is escaped.
Keys the page does not know are shown as they are rather than dropped: a newer run's field
is never hidden by an older reader, and a missing one (an older run) only drops its row.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from gradaccum import __version__
from gradaccum.app.folder import (
    BATCH_PLOT,
    CONFIG,
    INCIDENTS,
    LOSS_PLOT,
    MEMORY_PLOT,
    METRICS,
    PLAN,
    REPORT,
    RESUMES,
    RunFolder,
)
from gradaccum.app.folder import SUMMARY as SUMMARY_JSON
from gradaccum.app.report.metrics import SUMMARY, item_label
from gradaccum.memory import format_bytes
from gradaccum.planning import Fit, Plan
from gradaccum.planning.result import TIMING_HEAD, format_seconds, line_error

__all__ = ["render", "write_report"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED = "give a run folder written by gradaccum train"

# The plots the trainer draws, in the page's order, with what each shows (their alt text).
PLOTS = {
    LOSS_PLOT: "training loss per window and held-out loss against the optimizer step",
    MEMORY_PLOT: "peak training memory so far, in MiB, against the optimizer step",
    BATCH_PLOT: "effective batch per window and the critical batch B_simple with its 90% "
    "interval, in samples per step (B_simple's items over the window's items per sample, as "
    "the advice says it), against the samples seen; a reading whose interval reaches zero is "
    "a gap, and the interval is cut at 10x the batch",
}

STOPS = {
    "target_loss": "the loss target",
    "target_accuracy": "the accuracy target",
    "max_time": "its time limit",
    "max_memory": "its memory limit",
}

TARGETS = {  # key: (label, how its limit and value read)
    "target_loss": ("target loss", "number"),
    "target_accuracy": ("target accuracy", "number"),
    "max_time": ("time limit", "seconds"),
    "max_memory": ("memory limit", "bytes"),
}

STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 color:#1b1b1b;background:#fff;max-width:72rem;margin:1.5rem auto;padding:0 1rem}
h1{font-size:1.45rem;margin:0 0 .6rem}
h2{font-size:1.1rem;margin:1.8rem 0 .5rem;padding-bottom:.2rem;border-bottom:1px solid #ddd}
nav{font-size:.9rem;margin-bottom:1rem}
nav a{margin-right:.9rem;color:#0b57d0;text-decoration:none}
table{border-collapse:collapse;margin:.3rem 0 .6rem}
th,td{text-align:left;vertical-align:top;padding:.22rem 1.1rem .22rem 0;
 border-bottom:1px solid #eee}
th{font-weight:600;border-bottom:1px solid #ccc}
td.key{color:#444;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.lines{white-space:pre-line}
.status{padding:.5rem .8rem;border-left:4px solid #888;background:#f5f6f7}
.ok{border-color:#2e7d32}.warn{border-color:#c77700}
td.ok{color:#1b5e20}td.warn{color:#a15c00}
.dim{color:#777}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(26rem,1fr));gap:1rem}
figure{margin:0}
figure img{display:block;max-width:100%;height:auto;border:1px solid #e4e4e4}
figcaption{font-size:.9rem;color:#555;margin-top:.25rem}
details{margin:.3rem 0}summary{cursor:pointer;color:#555}
footer{margin-top:2.5rem;font-size:.85rem;color:#777}
"""


def write_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    summary: dict[str, Any] | None = None,
    metrics: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the run's page to ``out`` (default RUN_DIR/report.html; a folder: report.html
    in it) whole, and return where. ``summary`` and ``metrics``: what the caller has just
    computed (the end of a run), rendered as given instead of read back from the folder."""
    page = render(run_dir, summary=summary, metrics=metrics)
    file = Path(out) if out not in (None, "") else Path(run_dir) / REPORT
    if file.is_dir():
        file = file / REPORT
    if not file.parent.is_dir():
        raise ValueError(f"cannot write {file}: folder {file.parent} does not exist")
    tmp = file.with_name(file.name + ".tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, file)  # a reader never sees half a page
    except OSError as err:
        with contextlib.suppress(OSError):  # (a read-only folder refuses this too)
            tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write {file}: {err.strerror or err}") from None
    return file


def render(
    run_dir: str | Path,
    *,
    summary: dict[str, Any] | None = None,
    metrics: list[dict[str, Any]] | None = None,
) -> str:
    """The page about the run in ``run_dir``; ``summary`` and ``metrics`` as given, else read
    from the folder. Raises ValueError (one line, naming the path) when there is no run there
    or one of its files cannot be read."""
    folder = _open(run_dir)
    config = _object(folder, CONFIG)
    plan = _object(folder, PLAN) if (folder.path / PLAN).exists() else None
    if summary is None and (folder.path / SUMMARY_JSON).exists():
        summary = _object(folder, SUMMARY_JSON)
    if metrics is None:
        metrics = _lines(folder.path / METRICS)
    incidents = _lines(folder.path / INCIDENTS)
    resumes = _lines(folder.path / RESUMES)
    name = folder.path.resolve().name or str(folder.path)

    sections = [
        ("summary", "Summary", _summary(summary, metrics)),
        ("targets", "Targets and limits", _targets(summary)),
        ("incidents", "Incidents", _incidents(incidents, summary)),
        ("plots", "Plots", _plots(folder.path)),
        ("plan", "Plan", _plan(plan) if plan is not None else _p("no plan.json", "dim")),
        ("config", "Configuration", _config(config)),
        ("resumes", "Resumes", _resumes(resumes) if resumes else None),
    ]
    sections = [s for s in sections if s[2] is not None]
    status, tone = _status(summary, metrics, folder.path)
    body = [
        f"<h1>gradaccum run {_e(name)}</h1>",
        "<nav>" + "".join(f'<a href="#{key}">{title}</a>' for key, title, _ in sections) + "</nav>",
        f'<p class="status {tone}">{_e(status)}</p>',
    ]
    for key, title, content in sections:
        body.append(f'<h2 id="{key}">{title}</h2>\n{content}')
    body.append(
        f"<footer>written by gradaccum {_e(__version__)} from the files in the run folder</footer>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        # Nothing on this page may fetch anything: no network, no file beside it.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "img-src data:; style-src 'unsafe-inline'\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>gradaccum run {_e(name)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


# -- reading the run folder -------------------------------------------------------------------


def _open(run_dir: str | Path) -> RunFolder:
    folder = RunFolder(run_dir)
    path = folder.path
    if not path.exists():
        raise ValueError(f"{path} does not exist; {EXPECTED}")
    if not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder; {EXPECTED}")
    if not folder.holds_run():
        raise ValueError(f"{path} holds no gradaccum run (no config.json); {EXPECTED}")
    return folder


def _object(folder: RunFolder, name: str) -> dict[str, Any]:
    value = folder.read_json(name)
    if not isinstance(value, dict):
        raise ValueError(
            f"{folder.path / name} holds {type(value).__name__}, not a JSON object; it was "
            "changed outside gradaccum: restore it, or start a new run"
        )
    return value


def _lines(file: Path) -> list[dict[str, Any]]:
    """A .jsonl file's objects ([] when it is absent). A crash while appending can leave half
    a last line: that line is skipped; a damaged line anywhere else is an error."""
    if not file.exists():
        return []
    try:
        text = file.read_text()
    except OSError as err:
        raise ValueError(f"cannot read {file}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        line = file.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{file} line {line} is not text (byte {err.object[err.start]:#04x}); it was damaged "
            "outside gradaccum: restore it, or remove that line"
        ) from None
    raw = text.splitlines()
    out = []
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(raw) and not text.endswith("\n"):
                continue
            raise ValueError(
                f"{file} line {number} is not valid JSON ({err.msg}); it was damaged outside "
                "gradaccum: restore it, or remove that line"
            ) from None
        if not isinstance(value, dict):
            raise ValueError(f"{file} line {number} is not a JSON object")
        out.append(value)
    return out


# -- formatting values ------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _num(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        return f"{v:.4f}" if v == 0 or 1e-3 <= abs(v) < 1e6 else f"{v:.4g}"
    return v if isinstance(v, str) else _json(v)


def _bytes(n: Any) -> str:
    return format_bytes(n) if _is_number(n) else _num(n)


def _seconds(s: Any) -> str:
    return format_seconds(s) if _is_number(s) else _num(s)


def _changes(v: Any) -> str:
    """[[step, batch], ...] as "from step 10: 64, from step 20: 128"."""
    if not v:
        return "none"
    return ", ".join(f"from step {_num(step)}: {_num(batch)}" for step, batch in v)


def _json(v: Any) -> str:
    return json.dumps(v, default=str, ensure_ascii=False)


def _plain(v: Any) -> str:
    """A value of a kind the page does not know, in words: numbers rounded as the page
    rounds them, a list as its items, a mapping as "key: value"; never raw JSON."""
    if isinstance(v, dict):
        return "; ".join(f"{_label(str(k))}: {_plain(x)}" for k, x in v.items()) or "none"
    if isinstance(v, list | tuple):
        return ", ".join(_plain(x) for x in v) or "none"
    return _num(v)


def _raw(v: Any) -> str:
    """A setting as written: strings bare, everything else as compact JSON."""
    return v if isinstance(v, str) else _json(v)


def _label(key: str) -> str:
    return key.replace("_", " ")


# -- building blocks --------------------------------------------------------------------------

Cell = str | tuple[str, str]  # text, or (text, CSS class); text is escaped here


def _table(head: list[str] | None, rows: list[list[Cell]]) -> str:
    def cell(tag: str, c: Cell) -> str:
        text, cls = (c, "") if isinstance(c, str) else c
        attr = f' class="{cls}"' if cls else ""
        return f"<{tag}{attr}>{_e(text)}</{tag}>"

    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(cell("th", h) for h in head) + "</tr>")
    out += ["<tr>" + "".join(cell("td", c) for c in row) + "</tr>" for row in rows]
    out.append("</table>")
    return "\n".join(out)


def _p(text: str, cls: str = "") -> str:
    return f'<p class="{cls}">{_e(text)}</p>' if cls else f"<p>{_e(text)}</p>"


def _mapping(obj: dict[str, Any]) -> str:
    if not obj:
        return _p("(empty)", "dim")
    return _table(None, [[(k, "key mono"), (_raw(v), "mono")] for k, v in obj.items()])


def _config(config: dict[str, Any]) -> str:
    """config.json as what this run set: the options that differ from their defaults (the
    recipe's own, where it has them), the rest folded below them."""
    if not config:
        return _p("(empty)", "dim")
    defaults = _defaults(config)
    set_ = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}
    rest = {k: v for k, v in config.items() if k not in set_}
    if not defaults:  # an older or damaged config.json: shown as it is
        return _mapping(config)
    parts = [_mapping(set_) if set_ else _p("every option at its default", "dim")]
    if rest:
        parts.append(
            f"<details><summary>the other {len(rest)} options, at their defaults</summary>\n"
            + _mapping(rest)
            + "\n</details>"
        )
    return "\n".join(parts)


def _defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Every option's default for this run's recipe (config.json's form); {} when the file's
    recipe or model cannot make a configuration."""
    from gradaccum.app.config import TrainConfig

    source = {k: config[k] for k in ("recipe", "hf_model") if config.get(k) is not None}
    try:
        return TrainConfig.of(**source).flat()
    except (TypeError, ValueError):
        return {}


# -- the sections -----------------------------------------------------------------------------


_PLAN_BYTES = ("predicted_peak", "static_bytes", "overhead_bytes", "batch_bytes")
_PLAN_LABELS = {
    "predicted_peak": "peak measured at the planned size",
    "static_bytes": "static (parameters, buffers, optimizer state)",
    "overhead_bytes": "first-step overhead",
    "batch_bytes": "the window's input batch (held while it trains)",
    "seconds": "planning took",
}
_SOURCES = {"planned": "planned: measured", "given": "given with --micro-batch"}
_PREFER = {
    "fastest": "the fastest size that fits, timed (--prefer fastest)",
    "largest": "the largest size that fits, untimed (--prefer largest)",
}
# what the rows below say, together, of plan.json (the rest is shown as it is)
_PLAN_SAID = {
    *_PLAN_LABELS, "effective_batch", "world_size", "per_rank_batch", "micro_size",
    "micro_batches", "last_micro_size", "micro_sizes", "largest_fitting", "budget", "margin",
    "bytes_per_sample", "checkpointing", "checkpointed_blocks", "device", "precision", "sync",
    "source", "probes", "peak_fit", "activation_fit", "notes", "phases", "prefer", "timings",
    "choice", "timing_seconds",
}  # fmt: skip


def _plan(plan: dict[str, Any]) -> str:
    """plan.json as the console says it: a table in the run's units (samples, bytes as
    KiB/MiB/GiB, times rounded as the console rounds them), the run's phases as rows, the
    probes as a table of their own; a key the page does not know is shown as it is."""
    if not plan:
        return _p("(empty)", "dim")
    try:  # a whole plan: its words are the library's, as the console prints them
        full = Plan.from_dict(plan)
    except ValueError:  # part of one (an older or damaged file): what it holds
        full = None
    rows: list[list[Cell]] = []

    def row(label: str, text: str) -> None:
        rows.append([(label, "key"), (text, "mono")])

    sizes = plan.get("micro_sizes")
    if _is_number(plan.get("effective_batch")):
        shape = ""
        if isinstance(sizes, list) and sizes:
            shape = " = " + " + ".join(f"{n} x {size}" for size, n in Counter(sizes).items())
        ranks = plan.get("world_size")
        per = f" per rank, {ranks} ranks" if _is_number(ranks) and ranks > 1 else ""
        row("effective batch", f"{_num(plan['effective_batch'])} samples{shape}{per}")
    elif isinstance(sizes, list):
        row(
            "micro-batches of a window", " + ".join(f"{n} x {m}" for m, n in Counter(sizes).items())
        )
    if plan.get("micro_size") is not None:
        # why this size, in the summary's words (never the line's own largest: a fresh
        # process may have refused it)
        why = full.reason() if full is not None else plan.get("choice")
        fits = f" ({why})" if why else ""
        source = _SOURCES.get(plan.get("source"), plan.get("source"))
        how = f"; {source}" if source else ""
        row("micro-batch", f"{_num(plan['micro_size'])} samples{fits}{how}")
    if "checkpointing" in plan:
        blocks = plan.get("checkpointed_blocks") or []
        on = f"on, {len(blocks)} blocks" if blocks else "on"
        row("activation checkpointing", on if plan["checkpointing"] else "off")
    if _is_number(budget := plan.get("budget")):
        margin = plan.get("margin")
        kept = ""
        if _is_number(margin):
            kept = f"; {margin:.0%} kept free, {_bytes(budget * (1 - margin))} usable"
        row("budget", f"{_bytes(budget)} ({budget:,} bytes){kept}")
    for key in ("predicted_peak", "static_bytes", "overhead_bytes", "batch_bytes"):
        if _is_number(plan.get(key)) and (plan[key] or key != "batch_bytes"):
            row(_PLAN_LABELS[key], _bytes(plan[key]))
    for key, name in (("peak_fit", "peak line"), ("activation_fit", "activations saved")):
        if (fit := _fit(plan.get(key))) is None:
            continue
        line = f"{fit.line()} ({fit.quality()})" if key == "peak_fit" else fit.activations()
        row(name, line)
    where = [str(plan[k]) for k in ("device", "precision") if plan.get(k)]
    if plan.get("sync"):
        where.append(f"gradient sync once per {plan['sync']}")
    if where:
        row("measured on", ", ".join(where))
    if plan.get("prefer"):
        row("the size chosen", _PREFER.get(plan["prefer"], _plain(plan["prefer"])))
    if _is_number(plan.get("seconds")):
        took = _seconds(plan["seconds"])
        if full is not None and full.timing_seconds:
            took += f" ({full.timing_spent()})"
        row("planning took", took)
    for key, value in plan.items():
        if key not in _PLAN_SAID and value not in ([], None):
            row(_label(key), _plain(value))
    parts = [_table(None, rows)]
    if full is not None and full.timings:
        numbers = {0, 3, 4, 5, 6}  # the columns of numbers, right-aligned as the probes'
        timed = [
            [(c, "num") if i in numbers else c for i, c in enumerate(r)] for r in full.timing_rows()
        ]
        parts.append(_table(list(TIMING_HEAD), timed))
    phases = _phases(plan)
    if phases:
        parts.append(phases)
    probes = [p for p in plan.get("probes") or [] if isinstance(p, dict)]
    # each the whole peak, as the summary counts it: the static, first-step and batch bytes
    base = sum(
        v for k in ("static_bytes", "overhead_bytes", "batch_bytes") if _is_number(v := plan.get(k))
    )

    def whole(v: Any) -> str:
        return _bytes(base + v) if _is_number(v) else _num(v)

    if probes:
        parts.append(
            _table(
                [
                    "micro-batch",
                    "probe",
                    "measured peak",
                    "the line's prediction",
                    "fit error (of the peak above the base)",
                    "activations",
                ],
                [
                    [
                        (_num(p.get("micro_size")), "num"),
                        str(p.get("kind", "")),
                        (whole(p.get("peak_bytes")), "num"),
                        (whole(p.get("predicted_bytes")), "num"),
                        (_error(p.get("peak_bytes"), p.get("predicted_bytes")), "num"),
                        (_bytes(p.get("activation_bytes")), "num"),
                    ]
                    for p in probes
                ],
            )
        )
    # the closing lines as the summary says them, else the notes as saved
    notes = full.remarks() if full is not None else plan.get("notes") or []
    parts += [_p(str(n), "dim") for n in notes]
    return "\n".join(parts)


def _error(peak: Any, predicted: Any) -> str:
    if not (_is_number(peak) and _is_number(predicted)):
        return "—"
    return f"{line_error(peak, predicted):+.1%}"


def _phases(plan: dict[str, Any]) -> str | None:
    """The whole run, phase by phase (training's window, then each measured phase): its
    micro-batch and its peak, the largest marked."""
    phases = [p for p in plan.get("phases") or [] if isinstance(p, dict)]
    if not phases:
        return None
    runs = [("training", plan.get("micro_size"), plan.get("predicted_peak"))]
    runs += [(str(p.get("name")), p.get("micro_size"), p.get("peak_bytes")) for p in phases]
    peaks = [peak for _, _, peak in runs if _is_number(peak)]
    top = max(peaks, default=None)
    rows: list[list[Cell]] = []
    for name, size, peak in runs:
        mark = "the most" if peak == top and top is not None else ""
        rows.append([name, (_num(size), "num"), (_bytes(peak), "num"), (mark, "dim")])
    for p in phases:
        for size, peak in p.get("tried") or []:
            rows.append(
                [f"{p.get('name')} (tried)", (_num(size), "num"), (_bytes(peak), "num"),
                 ("above the usable budget", "warn")]
            )  # fmt: skip
    return _table(["phase of the run", "micro-batch", "peak, measured", ""], rows)


def _fit(saved: Any) -> Fit | None:
    """A plan.json line fit as the library's Fit (its words come from there), or None when
    the file holds something else."""
    if not isinstance(saved, dict):
        return None
    values = {k: saved.get(k) for k in ("intercept", "slope", "max_error")}
    if not all(_is_number(v) for v in values.values()):
        return None
    return Fit(**values, bound=saved.get("bound") is True)


def _status(
    summary: dict[str, Any] | None, metrics: list[dict[str, Any]], path: Path
) -> tuple[str, str]:
    last = metrics[-1].get("step") if metrics else None
    if summary is None:
        seen = f"metrics up to step {last}" if last is not None else "no metrics yet"
        return f"not finished: no summary.json; {seen}", "warn"
    steps = summary.get("steps")
    at = f" at step {steps}" if steps is not None else ""
    by = summary.get("stopped_by")
    targets = summary.get("targets") if isinstance(summary.get("targets"), dict) else {}
    if by is None or by == "length":
        text, tone = f"finished: trained its full length, {_num(steps)} optimizer steps", "ok"
    elif by in ("target_loss", "target_accuracy"):
        t = targets.get(by) if isinstance(targets.get(by), dict) else {}
        limit = f" ({_num(t['limit'])})" if t.get("limit") is not None else ""
        when = t.get("step") if t.get("step") is not None else steps
        text, tone = f"finished early: met {STOPS[by]}{limit} at step {_num(when)}", "ok"
    elif by in STOPS:
        t = targets.get(by) if isinstance(targets.get(by), dict) else {}
        fmt = _bytes if by == "max_memory" else _seconds
        limit = f" ({fmt(t['limit'])})" if t.get("limit") is not None else ""
        text, tone = f"stopped by {STOPS[by]}{limit}{at}", "warn"
    elif by == "guard":
        text = f"stopped by the incident guard{at}: it gave up (see the incidents below)"
        tone = "warn"
    elif by == "signal":
        text = f"stopped by a signal{at}; continue it with: gradaccum train --resume {path}"
        tone = "warn"
    else:
        text, tone = f"stopped by {by}{at}", "warn"
    if _is_number(last) and _is_number(steps) and last > steps:
        # summary.json is from an earlier session; a later one trained on and did not finish
        text += f" (an earlier session's summary: metrics.jsonl goes on to step {last})"
        tone = "warn"
    return text, tone


def _count(v: Any) -> str:
    """Samples and items (B_simple too, an estimate in items) as whole numbers: 3,182."""
    return f"{v:,.0f}" if _is_number(v) and v == v and abs(v) != float("inf") else _num(v)


FORMATS = {  # a metric's unit (report.metrics): how the page writes its value
    "bytes": _bytes,
    "seconds": _seconds,
    "changes": _changes,
    "items": _count,
    "samples": _count,
    "interval": lambda v: " to ".join(map(_count, v)) if v else "—",
}
# key: (label, formatter, the cell's class), in the page's order (metrics.SUMMARY); held_out_*
# follow the losses. A text keeps its line breaks, as the console prints it (the noise advice:
# the measurement, then the advice, on lines of their own)
SUMMARY_ROWS = {
    m.name: (m.label, FORMATS.get(m.unit, _num), "lines" if m.unit == "text" else "")
    for m in SUMMARY
    if m.page
}
SHOWN_ELSEWHERE = {"targets", "stopped_by", "item"}


def _summary(summary: dict[str, Any] | None, metrics: list[dict[str, Any]]) -> str:
    if summary is None:
        if not metrics:
            return _p("no summary.json and no metrics yet", "dim")
        last = metrics[-1]
        return _p("no summary.json (the run did not finish); its last metrics line:", "dim") + (
            _table(None, [[(_label(k), "key"), _num(v)] for k, v in last.items()])
        )
    rows: list[list[Cell]] = []
    held_out = [k for k in summary if k.startswith("held_out_")]
    for key, (label, fmt, cls) in SUMMARY_ROWS.items():
        label = item_label(key, label, summary)
        if key in summary:
            try:
                value = fmt(summary[key])
            except (TypeError, ValueError):  # an unexpected shape: show it as it is
                value = _raw(summary[key])
            rows.append([(label, "key"), (value, cls)])
        if key == "final_train_loss":
            rows += [[("held-out " + _label(k[9:]), "key"), _num(summary[k])] for k in held_out]
    known = {m.name for m in SUMMARY} | set(held_out) | SHOWN_ELSEWHERE
    rows += [[(_label(k), "key"), _num(v)] for k, v in summary.items() if k not in known]
    return _table(None, rows)


def _targets(summary: dict[str, Any] | None) -> str | None:
    targets = None if summary is None else summary.get("targets")
    if targets is None:
        return None  # a run from before targets existed, or an unfinished one
    if not isinstance(targets, dict):
        return _p(_raw(targets), "mono")
    if all(isinstance(t, dict) and t.get("status") == "not set" for t in targets.values()):
        return _p("no targets or limits were set", "dim")
    order = [k for k in TARGETS if k in targets] + [k for k in targets if k not in TARGETS]
    rows: list[list[Cell]] = []
    extra_keys = {"limit", "status", "value", "step", "samples", "seconds"}
    any_extra = False
    for key in order:
        t = targets[key]
        label, kind = TARGETS.get(key, (_label(key), "number"))
        if not isinstance(t, dict):
            rows.append([(label, "key"), _raw(t), "", "", "", ""])
            continue
        fmt = {"bytes": _bytes, "seconds": _seconds}.get(kind, _num)
        status = str(t.get("status", "—"))
        tone = {"met": "ok", "within": "ok", "missed": "warn", "reached": "warn"}.get(status, "dim")
        when = [
            text
            for text in (
                f"step {_num(t['step'])}" if t.get("step") is not None else "",
                f"{_num(t['samples'])} samples" if t.get("samples") is not None else "",
                _seconds(t["seconds"]) if t.get("seconds") is not None else "",
            )
            if text
        ]
        extra = "\n".join(f"{k}: {_raw(v)}" for k, v in t.items() if k not in extra_keys)
        any_extra = any_extra or bool(extra)
        rows.append(
            [
                (label, "key"),
                fmt(t.get("limit")),
                (status, tone),
                fmt(t.get("value")),
                ", ".join(when) or "—",
                (extra, "lines"),
            ]
        )
    head = ["", "limit", "status", "value", "when"] + (["other"] if any_extra else [])
    return _table(head, [r if any_extra else r[:5] for r in rows])


INCIDENT_KEYS = ("step", "samples", "kind", "seen", "action", "rolled_back_to", "retry")


def _incidents(incidents: list[dict[str, Any]], summary: dict[str, Any] | None) -> str:
    counted = None if summary is None else summary.get("incidents")
    if not incidents:
        if _is_number(counted) and counted > 0:
            return _p(f"summary.json counts {counted} incidents, but incidents.jsonl is missing")
        return _p("no incidents")
    rows: list[list[Cell]] = []
    any_extra = False
    for x in incidents:
        samples = x.get("samples")
        if isinstance(samples, list) and len(samples) == 2 and all(map(_is_number, samples)):
            samples = f"[{samples[0]:,}, {samples[1]:,})"
        seen = x.get("seen")
        if isinstance(seen, dict):
            seen = "\n".join(f"{k}: {_num(v)}" for k, v in seen.items())
        back = x.get("rolled_back_to")
        extra = "\n".join(f"{k}: {_raw(v)}" for k, v in x.items() if k not in INCIDENT_KEYS)
        any_extra = any_extra or bool(extra)
        rows.append(
            [
                _num(x.get("step")),
                _raw(samples) if samples is not None else "—",
                _num(x.get("kind")),
                (_raw(seen) if seen is not None else "—", "lines mono"),
                _num(x.get("action")),
                f"step {_num(back)}" if back is not None else "no",
                _num(x.get("retry")),
                (extra, "lines mono"),
            ]
        )
    head = ["step", "samples", "kind", "seen", "action", "rolled back to", "retry"]
    if any_extra:
        head.append("other")
    return _table(head, [r if any_extra else r[:7] for r in rows])


def _plots(path: Path) -> str:
    names = [n for n in PLOTS if (path / n).is_file()]
    names += sorted(p.name for p in path.glob("*.png") if p.is_file() and p.name not in PLOTS)
    if not names:
        return _p("no plots in the run folder", "dim")
    out = ['<div class="plots">']
    for name in names:
        try:
            data = (path / name).read_bytes()
        except OSError as err:
            out.append(_p(f"{name}: cannot read it ({err.strerror or err})", "dim"))
            continue
        if not data.startswith(PNG_SIGNATURE):
            out.append(_p(f"{name} is not a PNG image; not shown", "dim"))
            continue
        alt = PLOTS.get(name, f"the plot {name} from the run folder")
        src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        out.append(
            f'<figure><img src="{src}" alt="{_e(alt)}">'
            f"<figcaption>{_e(name)}: {_e(alt)}</figcaption></figure>"
        )
    return "\n".join(out + ["</div>"])


def _resumes(resumes: list[dict[str, Any]]) -> str:
    rows: list[list[Cell]] = []
    for r in resumes:
        changed = r.get("changed")
        if isinstance(changed, dict):
            text = "\n".join(
                f"{k}: {_raw(v[0])} → {_raw(v[1])}"
                if isinstance(v, list) and len(v) == 2
                else f"{k}: {_raw(v)}"
                for k, v in changed.items()
            )
            text = text or "no setting"
        else:
            text = _raw(changed)
        if r.get("after"):
            text = f"after: {r['after']}\n{text}"
        extra = {k: v for k, v in r.items() if k not in ("step", "changed", "after")}
        if extra:
            text += "\n" + "\n".join(f"{k}: {_raw(v)}" for k, v in extra.items())
        rows.append([_num(r.get("step")), (text, "lines mono")])
    return _table(["resumed at step", "what changed"], rows)
