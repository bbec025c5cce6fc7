"""A run's plots, drawn from its metrics lines at the end of a run: loss.png (train and
held-out loss, incidents marked), memory.png (peak training memory) and batch.png (the
effective batch against the critical batch B_simple and its interval)."""

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


def batch_plot(plt, out: Path, lines: list[dict[str, Any]]) -> None:
    """batch.png: the effective batch of each window against B_simple and its interval, both
    in items, over the samples seen."""
    seen = [x.get("samples", x["step"]) for x in lines]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.step(seen, [x["count"] for x in lines], where="pre", label="effective batch (items)")
    noise = [(n, x) for n, x in zip(seen, lines, strict=True) if x.get("noise_scale")]
    # A log scale down to a tenth of the smallest value shown: an interval reaching 0 is
    # drawn to the bottom edge rather than stretching the axis to nothing.
    shown = [x["count"] for x in lines if x["count"]] + [x["noise_scale"] for _, x in noise]
    bottom = 0.1 * min(shown, default=1)
    if noise:
        # Every window, NaN where there was no reading: a stretch without one is a gap in
        # the line, not a straight line drawn across it.
        nan = float("nan")
        read = [bool(x.get("noise_scale")) for x in lines]
        ax.plot(
            seen,
            [x["noise_scale"] if r else nan for x, r in zip(lines, read, strict=True)],
            label="B_simple",
        )
        ax.fill_between(
            seen,
            [max(x["noise_low"], bottom) if r else nan for x, r in zip(lines, read, strict=True)],
            [x["noise_high"] if r else nan for x, r in zip(lines, read, strict=True)],
            where=read,
            alpha=0.25,
            label="its 90% interval",
        )
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom)
    # Items as plain numbers (50, not 5 x 10^1), labelled at 1, 2 and 5 of each decade.
    from matplotlib import ticker

    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.10g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("samples seen")
    ax.set_ylabel("items per step")
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
