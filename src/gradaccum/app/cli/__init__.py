"""The `gradaccum` command: parse, build, call. One module per subcommand."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import signal
import sys
from typing import NoReturn

from gradaccum import __version__
from gradaccum.app.process import (
    EXIT_BAD_INPUT,
    EXIT_PEER_GONE,
    Stopped,
    ending,
    leave,
    out,
    quiet_third_parties,
    say,
    unwatch_stops,
    watch_loading,
    watch_stops,
)

__all__ = ["main", "out", "parser", "say"]


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (a value of the wrong type, an unknown flag) as one line, like
    every other error, instead of its usage block (``--help`` still prints it). A value that
    begins with a minus and a digit (``--budget -5MB``) is a value, refused by its option's
    check with the reason, not taken for a flag ("expected one argument")."""

    def __init__(self, *args, **kwargs) -> None:
        # --step 3 is not --steps 3: a prefix is a typo, answered with the flag it resembles
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # no flag of ours looks so
        self.given: list[str] = []

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint, prog = _suggestion(self, message)
        see = " See" if hint else "; see"
        say(f"gradaccum: error: {message}{hint}{see} {prog} --help")
        raise SystemExit(2)


def _commands(root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name (``train``: its parser)."""
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _closest(word: str, known: list[str]) -> str | None:
    found = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return found[0] if found else None


def _suggestion(parser: argparse.ArgumentParser, message: str) -> tuple[str, str]:
    """(``" (did you mean --recipe?)"`` or "", the help to point to) for argparse's refusal
    ``message``: a misspelled command, or flags no command of the line knows (argparse
    reports those at the top, whichever command they were given to)."""
    given = getattr(parser, "given", [])
    commands = _commands(parser)
    command = next((a for a in given if a in commands), None)
    prog = parser.prog if command is None else commands[command].prog
    choice = re.search(r"invalid choice: '([^']*)' \(choose from", message)
    if choice and "COMMAND" in message:
        word = choice.group(1)
        near = _closest(word, list(commands))
        if near is not None:
            return f"; did you mean {near}?", prog
        # `gradaccum --recipie digits`: a flag before any command took the command's place
        for i, flag in enumerate(a.split("=")[0] for a in given):
            for name, sub in commands.items():
                if flag.startswith("--") and (near := _closest(flag, _flags(sub))) is not None:
                    line = " ".join([name, *given[:i], near, *given[i + 1 :]])
                    return f"; a command comes first: did you mean gradaccum {line}?", prog
        return "", prog
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if unknown and command is not None:
        flags = _flags(commands[command])
        pairs = [
            (flag, near)
            for flag in (word.split("=")[0] for word in unknown.group(1).split())
            if flag.startswith("--") and (near := _closest(flag, flags)) is not None
        ]
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][1]}?", prog
        if pairs:
            return f"; did you mean {', '.join(f'{n} for {f}' for f, n in pairs)}?", prog
    return "", prog


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


def main(argv: list[str] | None = None) -> int:
    """The command (its console script, and ``python -m gradaccum``)."""
    if argv is None:  # the command itself, not a caller in Python: Ctrl-C while torch loads
        watch_loading()
    code = _main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave(code)  # under torchrun, after the process group is gone (process.leave)
    return code


def _main(argv: list[str] | None) -> int:
    """Exit codes (gradaccum.app.process): 0 done, 1 a check that failed, 2 bad input or an
    unusable file (one line on stderr), 4 a torchrun job's peer died, 128 + N stopped by
    signal N (after its checkpoint in training; before it, the start abandoned; Ctrl-C 130).
    GRADACCUM_DEBUG=1 (or --debug) shows the traceback behind a one-liner."""
    for name in ("stdout", "stderr"):  # started with it closed (`>&-`): output goes nowhere
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - for the process
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_third_parties()
    given = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("GRADACCUM_DEBUG", "") not in ("", "0") or "--debug" in given
    # The subcommands import torch here. Ctrl-C stays stop_while_loading's until they are
    # loaded: a KeyboardInterrupt raised inside numpy's import, which torch's C side makes,
    # is swallowed there and the command ran on as if never stopped.
    root = parser()
    interrupted = watch_stops()
    try:
        try:
            args = root.parse_args(argv)  # --help prints here: output that fails is one line
            if not hasattr(args, "run"):
                root.print_help()
                return EXIT_BAD_INPUT
            debug = debug or args.debug
            return args.run(args)
        except ValueError as err:  # bad input: one clear line, no traceback
            if debug:
                raise
            if interrupted and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                # a stop that landed inside an import (sklearn's, the digits recipe's data)
                # leaves it half made, and the recipe's refusal of the missing package
                # follows: the stop was the user's, said as such
                return _stopped(interrupted[0])
            # the command ends with this line: a stop signal from here (torchrun's SIGTERM
            # once another rank refused first) is noted, not raised through it as a traceback
            ending()
            from gradaccum.app.planning import as_flags  # the library's words as flags

            _for_the_job(f"gradaccum: error: {as_flags(str(err))}")
            _let_rank_0_say_it(interrupted)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt as stop:  # a stop outside training (planning, loading)
            if debug:
                raise
            return _peer_gone(stop, interrupted) or _stopped(
                stop.signum if isinstance(stop, Stopped) else signal.SIGINT
            )
        except OSError as err:  # what no message of ours names: the output, or a system refusal
            if debug:
                raise
            if interrupted:
                return _stopped(interrupted[0])
            _for_the_job(f"gradaccum: error: {_system_error(err)}")
            return EXIT_BAD_INPUT
        except Exception as err:
            # A Ctrl-C that landed inside an import (numpy's, under sklearn's) can leave that
            # module half made, and what fails next is not a KeyboardInterrupt: the stop was
            # the user's, said as such. Anything else is a bug, with its traceback.
            if debug:
                raise
            code = _peer_gone(err, interrupted)
            if code is not None:
                return code
            if interrupted:
                return _stopped(interrupted[0])
            raise
    finally:
        unwatch_stops()


def _for_the_job(line: str) -> None:
    """A line the whole job would say alike (a refusal every rank reaches, a stop torchrun
    passed to every rank): under torchrun rank 0 says it, once. What one rank alone sees is
    gathered to every rank where it happens (``launch.first_message``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0":
        say(line)


def _let_rank_0_say_it(signalled: list[int], patience: float = 5.0) -> None:
    """Under torchrun, a rank other than 0 that refuses waits (up to ``patience`` seconds,
    or until torchrun's SIGTERM) before it exits: its exit makes torchrun stop rank 0, which
    reaches the same refusal a moment later under load and would be stopped before saying
    it (``gradaccum: stopped by SIGTERM`` in its place). Rank 0 saying it ends the job."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0":
        return
    import time

    ending()  # torchrun's SIGTERM now ends the wait, not this process mid-line
    waited = time.monotonic() + patience
    while not signalled and time.monotonic() < waited:
        time.sleep(0.05)


def _stopped(signum: int) -> int:
    """A stop signal outside training, said in one line: its exit status, 128 + N."""
    ending()
    name = signal.Signals(signum).name
    _for_the_job("gradaccum: interrupted" if name == "SIGINT" else f"gradaccum: stopped by {name}")
    return 128 + signum


def _peer_gone(err: BaseException, signalled: list[int]) -> int | None:
    """Under torchrun, a collective that failed because another process of the job died:
    one line from each process left (the one that died cannot speak), EXIT_PEER_GONE.
    None for anything else, and for a rank other than 0 that a stop signal reached too:
    torchrun passes a stop to every rank, and rank 0 says it (when rank 0 is the one that
    ends first, the others' collectives fail in the middle of that same stop)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if signalled and os.environ.get("RANK", "0") != "0":
        return None
    from gradaccum.app import launch  # torch is loaded: a collective ran

    said = launch.peer_gone(err)
    if said is None:
        return None
    ending()  # torchrun's SIGTERM to the survivors must not cut this line short
    say(f"gradaccum: error: {said}")
    return EXIT_PEER_GONE


def _system_error(err: OSError) -> str:
    """One line for an OSError that no message of gradaccum's names."""
    reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename is not None else reason
