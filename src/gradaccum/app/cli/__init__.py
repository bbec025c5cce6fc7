"""The `gradaccum` command: parse, build, call. One module per subcommand."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from typing import NoReturn

from gradaccum import __version__


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (a value of the wrong type, an unknown flag) as one line, like
    every other error, instead of its usage block (``--help`` still prints it). A value that
    begins with a minus and a digit (``--budget -5MB``) is a value, refused by its option's
    check with the reason, not taken for a flag ("expected one argument")."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # no flag of ours looks so

    def error(self, message: str) -> NoReturn:
        say(f"gradaccum: error: {message}; see {self.prog} --help")
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    from gradaccum.app.cli import audit, check, plan, report, train

    root = _Parser(
        prog="gradaccum",
        description="Exact gradient accumulation for PyTorch: the large batch's gradient on "
        "the memory you have.",
    )
    root.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    root.add_argument(
        "--debug", action="store_true", help="show the traceback behind an error message"
    )
    sub = root.add_subparsers(title="commands", metavar="COMMAND")
    train.add_parser(sub)
    plan.add_parser(sub)
    check.add_parser(sub)
    audit.add_parser(sub)
    report.add_parser(sub)
    return root


def say(text: str) -> None:
    """A line on stderr that survives stderr being a closed pipe (``train 2>&1 | head``):
    the exit status must stay the one that says why the run stopped."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def out(*lines: str) -> None:
    """A command's result on stdout, flushed: output that cannot be written (stdout on a full
    disk or /dev/full) is one line saying so, not a traceback or a loss found at exit."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except OSError as err:
        # What is still buffered would fail again at exit: send it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise ValueError(f"cannot write the output (stdout): {err.strerror or err}") from None


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, after the process group is gone: leave without the interpreter's
        # teardown, in which gloo's threads can still abort a finished process (SIGABRT,
        # "terminate called without an active exception"; pytorch/pytorch#179291).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError):
                stream.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    """Exit codes: 0 done, 1 a check that failed, 2 bad input or an unusable file (one line
    on stderr), 130 Ctrl-C outside training, 128 + N a training run stopped by signal N after
    its checkpoint. GRADACCUM_DEBUG=1 (or --debug) shows the traceback behind a one-liner."""
    for name in ("stdout", "stderr"):  # started with it closed (`>&-`): output goes nowhere
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - for the process
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    given = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("GRADACCUM_DEBUG", "") not in ("", "0") or "--debug" in given
    interrupted = _watch_ctrl_c()
    try:
        try:
            args = parser().parse_args(argv)  # --help prints here: output that fails is one line
            if not hasattr(args, "run"):
                parser().print_help()
                return 2
            debug = debug or args.debug
            return args.run(args)
        except ValueError as err:  # bad input: one clear line, no traceback
            if debug:
                raise
            say(f"gradaccum: error: {err}")
            return 2
        except KeyboardInterrupt:  # Ctrl-C before training began (planning, loading)
            if debug:
                raise
            say("gradaccum: interrupted")
            return 130
        except OSError as err:  # what no message of ours names: the output, or a system refusal
            if debug:
                raise
            if interrupted:
                say("gradaccum: interrupted")
                return 130
            say(f"gradaccum: error: {_system_error(err)}")
            return 2
        except Exception:
            # A Ctrl-C that landed inside an import (numpy's, under sklearn's) can leave that
            # module half made, and what fails next is not a KeyboardInterrupt: the stop was
            # the user's, said as such. Anything else is a bug, with its traceback.
            if interrupted and not debug:
                say("gradaccum: interrupted")
                return 130
            raise
    finally:
        _unwatch_ctrl_c()


def _watch_ctrl_c() -> list[int]:
    """Python's own Ctrl-C handler (KeyboardInterrupt), noting that it fired: the list is
    non-empty once it has. It takes over from the one the library set while it loaded; a
    SIGINT the process was started ignoring stays ignored."""
    import signal

    from gradaccum import _stop_while_loading

    fired: list[int] = []
    if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, _stop_while_loading):
        return fired

    def handler(signum, frame):
        fired.append(signum)
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, handler)
        _WATCHING.append(handler)
    except ValueError:  # not the main thread (an embedding program): leave it alone
        pass
    return fired


_WATCHING: list = []  # the handler _watch_ctrl_c installed, until _unwatch_ctrl_c


def _unwatch_ctrl_c() -> None:
    """Python's own handler back (main() may be called again in one process: the tests)."""
    import signal

    while _WATCHING:
        if signal.getsignal(signal.SIGINT) is _WATCHING.pop():
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _system_error(err: OSError) -> str:
    """One line for an OSError that no message of gradaccum's names."""
    reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename is not None else reason
