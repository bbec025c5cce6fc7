"""app/estimating.py: the estimating process forked from the command is the process
``python -m gradaccum.app.estimating`` would be: only its three pipes, its own signal
handlers, ended by the end of its input or by a kill."""

from __future__ import annotations

import os
import select
import signal
import subprocess

import pytest

from gradaccum.app import estimating
from gradaccum.app.process import EXIT_ORPHANED

pytestmark = pytest.mark.skipif(not estimating._can_fork(), reason="forks only on Linux")


def test_the_forked_process_holds_none_of_the_commands_files():
    """A pipe the command holds when it forks: once the command closes its end, the reader
    sees the end at once (the child closed its copy); the child still waits for its
    request."""
    read, write = os.pipe()
    child = estimating._Forked()
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        assert ready and os.read(read, 1) == b"", "the trace process kept the command's file"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.3)
    finally:
        os.close(read)
        child.kill()
        child.wait()


def test_the_forked_process_ends_quietly_when_its_input_ends_before_a_request():
    child = estimating._Forked()
    child.stdin.close()
    assert child.wait(timeout=60) == EXIT_ORPHANED
    assert child.stdout.read() == "" and child.stderr.read() == ""


def test_the_forked_process_has_the_signals_own_handlers_not_the_commands():
    """The command's SIGTERM handler (a run's graceful stop) is not the trace process's: a
    SIGTERM ends it as it would a new process, and a kill is said as a signal."""
    caught = []
    previous = signal.signal(signal.SIGTERM, lambda *_: caught.append(1))
    try:
        child = estimating._Forked()
    finally:
        signal.signal(signal.SIGTERM, previous)
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM and not caught
    other = estimating._Forked()
    other.kill()
    assert other.wait(timeout=60) == -signal.SIGKILL
