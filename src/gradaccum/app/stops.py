"""Stops asked from outside a run: SIGINT, SIGTERM, SIGHUP, or its output failing. A stop is
taken at the next window boundary, after the checkpoint, and every rank of a job takes it
together."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from gradaccum.app import launch

__all__ = ["STOP_SIGNALS", "Interrupted", "StopSignals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):  # noqa: N818 - it is a stop, not an error
    """Training stopped on a signal (SIGINT, SIGTERM, SIGHUP) or a closed output pipe, after
    checkpointing at a window boundary."""

    def __init__(self, step: int, out: Path, signum: int, failure: str | None = None) -> None:
        why = "its output pipe closing" if signum == signal.SIGPIPE else signal.Signals(signum).name
        if failure is not None:  # stdout on a full disk, /dev/full, a dead terminal
            why = f"its output failing ({failure})"
        super().__init__(
            f"stopped by {why} at step {step}; checkpoint saved; "
            f"continue with: {launch.resume_command(out)}"
        )
        self.step, self.out, self.signum = step, out, signum


class StopSignals:
    """The stop signals caught while a run trains (``with StopSignals() as stops``), their
    handlers put back after. ``requested`` holds what arrived, in order (a failing output
    appends SIGPIPE to it: ``gradaccum.app.process.Output``). A signal the run was started
    ignoring (nohup's SIGHUP, a shell's background SIGINT) stays ignored: whoever started
    the run asked for that."""

    def __init__(self, requested: list[int] | None = None) -> None:
        self.requested: list[int] = [] if requested is None else requested
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        caught = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
        self._previous = {s: signal.signal(s, self._note) for s in caught}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _note(self, signum: int, frame: Any) -> None:
        self.requested.append(signum)

    def agreed(self) -> bool:
        """Whether the job stops at this boundary: a signal on any rank stops them all.
        Decided once per window: a signal that arrives after this waits for the next
        boundary (reading ``requested`` again later let a signal landing between the ranks'
        agreement and the check stop one rank alone, leaving the other in a collective)."""
        return launch.any_rank(bool(self.requested))

    def interrupted(self, step: int, out: Path, failure: str | None = None) -> Interrupted:
        """The stop, to raise once the boundary's checkpoint is written."""
        signum = self.requested[0] if self.requested else signal.SIGTERM
        return Interrupted(step, out, signum, failure)
