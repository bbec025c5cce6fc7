"""What a run folder says at the end: summary.py (summary.json and the table), html.py
(report.html), plots.py (the PNGs), events.py (TensorBoard's event files)."""

from gradaccum.app.report.html import REPORT, render, write_report

__all__ = ["REPORT", "render", "write_report"]
