"""A run's plots, drawn from its metrics lines at the end of a run: loss.png (train and
held-out loss, incidents marked), memory.png (peak training memory) and batch.png (the
effective batch against the critical batch B_simple and its interval, in samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradaccum.app.folder import BATCH_PLOT, LOSS_PLOT, MEMORY_PLOT

__all__ = ["batch_plot", "draw", "plan_plot"]


def draw(out: Path, lines: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> None:
    """loss.png (incidents marked), memory.png and batch.png in the run folder ``out``."""
    import matplotlib  # imported here: slow to import, and only the end of a run plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [x["step"] for x in lines if x["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, [x["loss"] for x in lines if x["loss"] is not None], label="train (window)")
    evals = [x for x in lines if "eval_loss" in x]
    if evals:
        ax.plot(
            [x["step"] for x in evals],
            [x["eval_loss"] for x in evals],
            marker="o",
            label="held-out",
        )
    for i, incident in enumerate(incidents):
        ax.axvline(
            incident["step"],
            color="tab:red",
            alpha=0.5,
            linestyle="--",
            label="incident (rolled back)" if i == 0 else None,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per item")
    ax.set_title(f"{out.name}: loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / LOSS_PLOT, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([x["step"] for x in lines], [x["peak_memory"] / 2**20 for x in lines])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("peak training memory so far (MiB)")
    ax.set_title(f"{out.name}: memory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / MEMORY_PLOT, dpi=110)
    plt.close(fig)
    batch_plot(plt, out, lines)


# The interval's top is drawn at most this many times the largest effective batch: the
# readings are prefixes of windows no larger than it, and say little of batches far beyond
_CEILING = 10


def batch_plot(plt, out: Path, lines: list[dict[str, Any]]) -> None:
    """batch.png: the effective batch of each window against B_simple and its 90% interval,
    in the effective batch's own unit (samples: B_simple's items divided by the window's
    items per sample, as the advice says it), over the samples seen. A reading whose
    interval reaches zero (|G|^2 not clearly above zero) says nothing of B and is left out,
    a gap in the line; the interval is cut at 10x the largest batch, where the readings
    stop saying anything."""
    seen = [x.get("samples", x["step"]) for x in lines]
    # items per sample of each window (an older metrics line without effective_batch: items)
    per = [
        x["count"] / x["effective_batch"] if x.get("effective_batch") and x["count"] else 1.0
        for x in lines
    ]
    batch = [x.get("effective_batch") or x["count"] for x in lines]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    unit = "samples" if any(x.get("effective_batch") for x in lines) else "items"
    ax.step(seen, batch, where="pre", label=f"effective batch ({unit})")
    read = [bool(x.get("noise_scale")) and (x.get("noise_low") or 0) > 0 for x in lines]
    top = _CEILING * max(batch, default=1)
    shown = [b for b in batch if b] + [
        x["noise_scale"] / p for x, p, r in zip(lines, per, read, strict=True) if r
    ]
    bottom = 0.1 * min(shown, default=1)
    if any(read):
        # Every window, NaN where there was no reading: a stretch without one is a gap in
        # the line, not a straight line drawn across it.
        nan = float("nan")
        mid = [x["noise_scale"] / p if r else nan for x, p, r in zip(lines, per, read, strict=True)]
        low = [x["noise_low"] / p if r else nan for x, p, r in zip(lines, per, read, strict=True)]
        high = [x["noise_high"] / p if r else nan for x, p, r in zip(lines, per, read, strict=True)]
        cut = any(h > top for h in high if h == h)
        ax.plot(seen, [min(m, top) if m == m else m for m in mid], label="B_simple")
        ax.fill_between(
            seen,
            [max(v, bottom) if v == v else v for v in low],
            [min(v, top) if v == v else v for v in high],
            where=read,
            alpha=0.25,
            label="its 90% interval" + (f" (cut at {_CEILING}x the batch)" if cut else ""),
        )
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom, top=top)
    # Plain numbers (50, not 5 x 10^1), labelled at 1, 2 and 5 of each decade.
    from matplotlib import ticker

    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.10g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("samples seen")
    ax.set_ylabel(f"{unit} per step")
    ax.set_title(f"{out.name}: effective batch and critical batch")
    ax.legend(loc="best")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / BATCH_PLOT, dpi=110)
    plt.close(fig)


def plan_plot(result: Any, path: str) -> Path:
    """The plan's plot, written to ``path`` (PNG when it names no format: matplotlib would
    add .png); returns the file written."""
    import matplotlib  # imported here: slow to import, and only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    top = max(result.micro_size, max(p.micro_size for p in result.probes))
    xs = list(range(1, top + 1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [result.predict(x) / mib for x in xs], label="predicted peak")
    ax.scatter(
        [p.micro_size for p in result.probes],
        [(result.base_bytes + p.peak_bytes) / mib for p in result.probes],
        color="black",
        zorder=3,
        label="measured (probes)",
    )
    ax.axhline(result.budget / mib, color="red", linestyle="--", label="budget")
    ax.axhline(
        result.budget * (1 - result.margin) / mib,
        color="red",
        linestyle=":",
        label=f"budget less {result.margin:.0%} margin",
    )
    ax.axvline(
        result.micro_size,
        color="green",
        linestyle="-.",
        label=f"planned micro-batch {result.micro_size}",
    )
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"plan: effective batch {result.effective_batch} on {result.device}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written = Path(path) if Path(path).suffix else Path(path).with_suffix(".png")
    fig.savefig(written, dpi=110)
    plt.close(fig)
    return written
