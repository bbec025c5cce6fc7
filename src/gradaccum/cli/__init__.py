"""The `gradaccum` command: parse, build, call. One module per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys

from gradaccum import __version__


def parser() -> argparse.ArgumentParser:
    from gradaccum.cli import check, plan, train

    root = argparse.ArgumentParser(
        prog="gradaccum",
        description="Exact gradient accumulation for PyTorch: the large batch's gradient on "
        "the memory you have.",
    )
    root.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    sub = root.add_subparsers(title="commands", metavar="COMMAND")
    train.add_parser(sub)
    plan.add_parser(sub)
    check.add_parser(sub)
    return root


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if not hasattr(args, "run"):
        parser().print_help()
        return 2
    try:
        return args.run(args)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"gradaccum: error: {err}", file=sys.stderr)
        return 2
