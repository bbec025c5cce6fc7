"""gradaccum.app.stops: the stop signals caught while training, and put back after."""

import os
import signal

from gradaccum.app.stops import Interrupted, StopSignals


def test_a_signal_inside_the_watch_is_noted_and_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stops:
        assert not stops.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.requested == [signal.SIGTERM]
        assert stops.agreed()  # alone, its own verdict
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_the_process_ignores_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals() as stops:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert stops.requested == []
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_stop_names_the_first_signal_and_how_to_continue(tmp_path):
    stops = StopSignals([signal.SIGINT, signal.SIGTERM])
    stop = stops.interrupted(7, tmp_path)
    assert isinstance(stop, Interrupted) and stop.signum == signal.SIGINT and stop.step == 7
    assert str(stop) == (
        f"stopped by SIGINT at step 7; checkpoint saved; continue with: gradaccum train "
        f"--resume {tmp_path}"
    )
    failed = StopSignals([signal.SIGPIPE]).interrupted(3, tmp_path, "No space left on device")
    assert "stopped by its output failing (No space left on device) at step 3" in str(failed)
