"""`gradaccum report`: one self-contained HTML page about a run folder."""

from __future__ import annotations

import argparse

from gradaccum.app.process import out
from gradaccum.app.report import REPORT, write_report


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write a run's report: one HTML page that needs nothing but itself",
        description="Write one HTML page about a training run: how it ended, its summary "
        "numbers, targets and limits, incidents, plots, plan, configuration and resumes. The "
        "page is self-contained (inline CSS, plots embedded, no script, no network), so it "
        "can be mailed or archived alone. gradaccum train writes it at the end of every run.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder gradaccum train wrote")
    parser.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help=f"write the page here instead of RUN_DIR/{REPORT} (a folder: {REPORT} in it)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out(str(write_report(args.run_dir, args.out)))
    return 0
