"""The command's process: its signals, exit codes and output. All of it lives here.

Exit codes: 0 done, 1 a check that failed (or the incident guard gave up), 2 bad input or an
unusable file (one line on stderr), 3 a helper process whose parent is gone, 4 a process of a
torchrun job whose peer died, 128 + N stopped by signal N (a training run after its
checkpoint; before training, a start abandoned as any failed start is; Ctrl-C: 130).

Output survives a closed pipe (``gradaccum train | head``) and a stream that cannot be
written (stdout on a full disk): the exit status must stay the one that says why the run
stopped. The Ctrl-C handler for the seconds while torch loads is installed by the command's
entry point before anything heavy is imported (``watch_loading``); a program that imports the
library keeps its own handler.

This module imports only the standard library: the command's entry point imports it before
torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_ORPHANED",
    "EXIT_PEER_GONE",
    "Output",
    "exit_on_end_of_input",
    "leave",
    "out",
    "quiet",
    "quiet_third_parties",
    "say",
    "Stopped",
    "THIRD_PARTIES",
    "ThirdParties",
    "ending",
    "unwatch_stops",
    "watch_loading",
    "watch_stops",
]

EXIT_FAILED = 1  # a check that failed, or the incident guard gave up
EXIT_BAD_INPUT = 2  # bad input or an unusable file: one line on stderr
EXIT_ORPHANED = 3  # a helper process (planning, measuring) whose parent is gone
EXIT_PEER_GONE = 4  # under torchrun: another process of the job died
EXIT_INTERRUPTED = 130  # Ctrl-C outside training (128 + SIGINT, as for any stop signal)


def say(text: str) -> None:
    """A line on stderr that survives stderr being a closed pipe (``train 2>&1 | head``)."""
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


class Output:
    """A training run's log, surviving a closed pipe or output that cannot be written: the
    first write that fails stops training at the next window boundary, as SIGPIPE would
    (``stop`` receives it), and later writes go nowhere."""

    def __init__(self, log, stop: list[int]) -> None:
        self.log, self.stop, self.closed = log, stop, False
        self.failure: str | None = None  # why the output failed, when it was not a pipe

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.closed:
            return
        try:
            self.log(*args, **kwargs)
            sys.stdout.flush()
        except OSError as err:
            self.closed = True
            if not isinstance(err, BrokenPipeError):
                self.failure = err.strerror or str(err)
            # Point stdout at /dev/null so the interpreter's own flush at exit cannot fail too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.stop.append(signal.SIGPIPE)


def quiet(*args: Any, **kwargs: Any) -> None:
    """The log of a process that does not speak (ranks other than 0: rank 0 speaks for the
    job)."""


def quiet_third_parties() -> ThirdParties:
    """What other packages say that is not about the user's run, kept off the terminal, in
    the command and the processes it starts (their output is its log): DeepSpeed's "Setting
    accelerator to CPU" (transformers and accelerate import DeepSpeed when it is installed;
    gradaccum never runs it), transformers' loading and saving progress bars (turned off:
    they count files), PEFT's use of a property transformers deprecates, and any other
    package's INFO through the root logger's handler (matplotlib's font cache note). What is said
    is kept (``ThirdParties``, returned): a training run writes it to its folder's
    third_party.log. Called before they are imported; a user's own
    HF_HUB_DISABLE_PROGRESS_BARS is kept."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # inherited by the children
    if "huggingface_hub" in sys.modules:  # imported already: it read the variable then
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    # DeepSpeed's logger makes its own level and handler as it is imported; a filter on the
    # logger, set now, stays
    ds = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _AsideDeepSpeed) for f in ds.filters):
        ds.addFilter(_AsideDeepSpeed())
    if not isinstance(warnings.showwarning, _AsideWarnings):
        warnings.showwarning = _AsideWarnings(warnings.showwarning)
    # another package's INFO (matplotlib's "generated new fontManager" as a fresh machine's
    # first run draws its plots) reaches the terminal through the root's handler: kept aside
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _AsideInfo) for f in handler.filters):
            handler.addFilter(_AsideInfo())
    return THIRD_PARTIES


class ThirdParties:
    """What ``quiet_third_parties`` kept off the terminal, as lines: held in memory until
    ``into(file)`` (a training run, once its folder holds the run), then written there with
    whatever follows, until ``close()``. A process that never names a file (plan, audit,
    check, the plan's fresh processes, a torchrun rank other than 0) drops what it held as
    it ends: none of it is about the user's run, and the run's own process, which loads and
    saves the same model, writes its own."""

    HELD = 200  # lines held before a file is named; the rest of a flood is dropped

    def __init__(self) -> None:
        self.held: list[str] = []
        self.file: str | os.PathLike | None = None

    def keep(self, line: str) -> None:
        if self.file is None:
            if len(self.held) < self.HELD:
                self.held.append(line)
            return
        self._write([line])

    def into(self, file: str | os.PathLike | None) -> None:
        """Write what is held to ``file`` (appended: a resumed run adds to its log), then
        each line as it is said; ``None`` (a process that writes no run folder): drop it."""
        self.file, held, self.held = file, self.held, []
        if file is not None:
            self._write(held)

    def close(self) -> None:
        """The run is over: hold again (for the next run of this process, if any)."""
        self.file = None

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            with open(self.file, "a", encoding="utf-8") as log:
                log.writelines(f"{line}\n" for line in lines)
        except OSError:
            pass  # another package's chatter is never a reason to stop a run


# The process's own: logging's filters and warnings' hook are the process's too.
THIRD_PARTIES = ThirdParties()


def _stamp(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))


class _AsideDeepSpeed(logging.Filter):
    """DeepSpeed's guess at the hardware, said as it is imported: kept aside."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Setting accelerator to" not in message:
            return True
        THIRD_PARTIES.keep(f"{_stamp(record.created)} {record.name} {record.levelname}: {message}")
        return False


class _AsideInfo(logging.Filter):
    """Records below WARNING from loggers other than gradaccum's: another package's notes on
    its own work, kept aside; its warnings and errors are shown as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if (
            record.levelno >= logging.WARNING
            or name == "gradaccum"
            or name.startswith("gradaccum.")
        ):
            return True
        if not getattr(record, "gradaccum_kept", False):  # once, whatever the handlers
            record.gradaccum_kept = True
            THIRD_PARTIES.keep(
                f"{_stamp(record.created)} {name} {record.levelname}: {record.getMessage()}"
            )
        return False


class _AsideWarnings:
    """``warnings.showwarning`` with the warnings of other packages that are not about the
    run (ASIDE: category and the start of the message) kept aside; every other warning is
    shown as before."""

    ASIDE = ((FutureWarning, "`is_gradient_checkpointing` is deprecated"),)

    def __init__(self, shown: Any) -> None:
        self.shown = shown

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if any(issubclass(category, kind) and str(message).startswith(start)
               for kind, start in self.ASIDE):  # fmt: skip
            THIRD_PARTIES.keep(
                f"{_stamp(time.time())} {category.__name__} ({filename}:{lineno}): {message}"
            )
            return
        self.shown(message, category, filename, lineno, file, line)


def leave(code: int) -> None:
    """End the process now with ``code``, its output flushed, without the interpreter's
    teardown: under torchrun gloo's threads can abort a finished process in it (SIGABRT;
    pytorch/pytorch#179291), and under ``python -m`` CPython can end a process that handled
    Ctrl-C by SIGINT after it, which a shell reads as another status."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)


def stop_while_loading(signum: int, frame: Any) -> None:
    """The command's Ctrl-C (or SIGTERM, SIGHUP) while modules load (torch takes seconds):
    one line and exit 128 + N (130 for Ctrl-C), as for every other stop. Not a
    KeyboardInterrupt: torch's C side imports numpy and drops whatever that import raises,
    leaving numpy half made (the next import of it fails, or sklearn's recurses until it
    dies), and one raised inside a C++ initialiser aborts the process. Nothing is written
    yet, so leaving at once loses nothing."""
    if signum == signal.SIGINT:
        print("gradaccum: interrupted", file=sys.stderr, flush=True)
    else:
        print(f"gradaccum: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def watch_loading() -> None:
    """The command's entry point, first thing: ``stop_while_loading`` for Ctrl-C, SIGTERM
    and SIGHUP until ``watch_stops`` takes over (their default ended the process with no
    word; under torchrun SIGTERM and SIGHUP keep it). A signal the process was started
    ignoring stays ignored."""
    signals = [(signal.SIGINT, signal.default_int_handler)]
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # (torchrun's SIGTERM ends a job's
        # other processes when one fails: that process's line is the job's one)
        signals += [(signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL)]
    for signum, default in signals:
        if signal.getsignal(signum) is default:
            with contextlib.suppress(ValueError):  # not the main thread (an embedding program)
                signal.signal(signum, stop_while_loading)


class Stopped(KeyboardInterrupt):  # noqa: N818 - a stop, as Ctrl-C's KeyboardInterrupt is
    """A stop signal (SIGINT, SIGTERM, SIGHUP) outside training, where the command's handler
    (``watch_stops``) turns it into an exception. A KeyboardInterrupt on purpose: whatever
    handles Ctrl-C while a run starts (the planning child killed, the new folder abandoned,
    one line said) handles SIGTERM and SIGHUP the same way, in the same places."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_WATCHING: dict[int, Any] = {}  # signal -> the handler watch_stops installed
_ENDING: list[bool] = []  # non-empty once the command is ending (``ending``)


def watch_stops() -> list[int]:
    """The command's handler for SIGINT, SIGTERM and SIGHUP outside training: it raises
    ``Stopped`` (a KeyboardInterrupt), noting the signal in the list returned. It takes over
    from Python's own Ctrl-C handler and ``stop_while_loading``, and from the default action
    of SIGTERM and SIGHUP (which ended the process where it stood, leaving a starting run's
    lock and config.json and saying nothing). A signal the process was started ignoring, or
    one its embedding program handles, is left alone. Training takes the three over itself
    while it runs (``gradaccum.app.stops.StopSignals``) and puts these back after."""
    fired: list[int] = []
    ours = {sig: (signal.SIG_DFL, stop_while_loading) for sig in STOPS}
    ours[signal.SIGINT] = (signal.default_int_handler, stop_while_loading)

    def handler(signum, frame):
        fired.append(signum)
        if not _ENDING:
            raise Stopped(signum)

    for sig in STOPS:
        if signal.getsignal(sig) not in ours.get(sig, (signal.SIG_DFL,)):
            continue
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread (an embedding program): leave it alone
            return fired
        _WATCHING[sig] = handler
    return fired


def ending() -> None:
    """The command is ending with its line said or being said: a stop signal from now on is
    noted, not raised (torchrun's SIGTERM to the processes left must not turn that line
    into a traceback)."""
    _ENDING.append(True)


def unwatch_stops() -> None:
    """The handlers ``watch_stops`` replaced, back (the command may run again in one
    process: the tests)."""
    _ENDING.clear()
    for sig, handler in list(_WATCHING.items()):
        del _WATCHING[sig]
        if signal.getsignal(sig) is handler:
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )


def exit_on_end_of_input() -> None:
    """A helper process: exit as soon as stdin closes (its parent is gone or has no use for
    it)."""

    def watch() -> None:
        while sys.stdin.readline():
            pass
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, daemon=True).start()
