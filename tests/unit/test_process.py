"""gradaccum.app.process: output that survives a failing stream, and the Ctrl-C handlers."""

import signal

import pytest

from gradaccum.app import process


def test_a_log_whose_write_fails_stops_the_run_once_and_goes_quiet(monkeypatch):
    import os

    calls = []
    dup = []
    monkeypatch.setattr(os, "dup2", lambda a, b: dup.append(b))  # keep pytest's stdout

    def failing(*args, **kwargs):
        calls.append(args)
        raise OSError(28, "No space left on device")

    stop: list[int] = []
    log = process.Output(failing, stop)
    log("one")
    log("two")  # nowhere now
    assert calls == [("one",)] and log.closed and log.failure == "No space left on device"
    assert stop == [signal.SIGPIPE] and len(dup) == 1


def test_a_closed_pipe_is_a_stop_without_a_failure(monkeypatch):
    import os

    monkeypatch.setattr(os, "dup2", lambda a, b: None)

    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    stop: list[int] = []
    log = process.Output(closed, stop)
    log("x")
    assert stop == [signal.SIGPIPE] and log.failure is None


def test_the_loading_handler_is_installed_only_over_pythons_own_and_then_replaced():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        process.watch_loading()
        assert signal.getsignal(signal.SIGINT) is process.stop_while_loading
        assert signal.getsignal(signal.SIGTERM) is process.stop_while_loading
        fired = process.watch_stops()
        for signum in (signal.SIGINT, signal.SIGTERM):  # both taken over (a SIGTERM left to
            # the loading handler ended planning where it stood, its run folder left)
            assert signal.getsignal(signum) not in (
                process.stop_while_loading,
                signal.default_int_handler,
                signal.SIG_DFL,
            )
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert fired == [signal.SIGINT]
        process.unwatch_stops()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # started ignoring it: left alone
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (nohup)
        process.watch_loading()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is process.stop_while_loading
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_sigterm_and_sighup_outside_training_stop_as_ctrl_c_does_and_are_put_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    fired = process.watch_stops()
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            with pytest.raises(KeyboardInterrupt) as stop:
                signal.raise_signal(signum)
            assert isinstance(stop.value, process.Stopped) and stop.value.signum == signum
        assert fired == [signal.SIGTERM, signal.SIGHUP]
    finally:
        process.unwatch_stops()
    assert {s: signal.getsignal(s) for s in before} == before


def test_out_on_a_full_disk_is_one_line(monkeypatch):
    """stdout on /dev/full, which fails every write as a full disk does (its descriptor is
    left alone: pytest's own output goes there)."""
    import contextlib
    import os
    import sys

    monkeypatch.setattr(os, "dup2", lambda a, b: None)
    full = open("/dev/full", "w")  # noqa: SIM115 - its close fails too: suppressed below
    monkeypatch.setattr(sys, "stdout", full)
    try:
        with pytest.raises(ValueError) as refused:
            process.out("a line")
    finally:
        with contextlib.suppress(OSError):
            full.close()
    assert str(refused.value) == "cannot write the output (stdout): No space left on device"


def test_what_other_packages_say_is_kept_off_the_terminal_and_then_in_the_run_folder(
    tmp_path, capfd
):
    """DeepSpeed's hardware guess (a record on its own logger, which prints it itself) and
    transformers' deprecation that PEFT sets off are held while there is no run folder, then
    written to third_party.log with what follows; any other warning is shown as before."""
    import logging
    import sys
    import warnings

    from gradaccum.app.folder import THIRD_PARTY

    deepspeed = logging.getLogger("DeepSpeed")
    own = logging.StreamHandler(sys.stderr)  # DeepSpeed's logger writes to stderr itself
    deepspeed.addHandler(own)
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            kept = process.quiet_third_parties()
            kept.close()  # whatever a run earlier in this process left
            kept.held.clear()
            deepspeed.warning("Setting accelerator to CPU. If you have GPU or other ...")
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                          FutureWarning, stacklevel=1)  # fmt: skip
            warnings.warn("about the run", UserWarning, stacklevel=1)
            log = tmp_path / THIRD_PARTY
            assert not log.exists()  # held: no folder yet
            kept.into(log)
            deepspeed.warning("Setting accelerator to CPU, once more")
            kept.close()
            deepspeed.warning("Setting accelerator to CPU after the run")  # held, not written
    finally:
        deepspeed.removeHandler(own)
        process.THIRD_PARTIES.held.clear()
    assert [str(w.message) for w in shown] == ["about the run"]
    assert "Setting accelerator" not in capfd.readouterr().err
    lines = log.read_text().splitlines()
    assert len(lines) == 3, lines
    assert "DeepSpeed WARNING: Setting accelerator to CPU. If you have GPU" in lines[0]
    assert "FutureWarning (" in lines[1] and "`is_gradient_checkpointing` is depre" in lines[1]
    assert lines[2].endswith("DeepSpeed WARNING: Setting accelerator to CPU, once more")


def test_another_packages_info_is_kept_aside_and_its_warnings_shown(capfd):
    """The command's root handler (basicConfig at INFO) showed matplotlib's "generated new
    fontManager" as a fresh machine's first run drew its plots: another package's INFO is
    held for third_party.log; its warnings, and gradaccum's own INFO, are shown."""
    import logging
    import sys

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        kept = process.quiet_third_parties()
        kept.close()
        kept.held.clear()
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("matplotlib.font_manager").warning("a font is missing")
        logging.getLogger("gradaccum.app").info("planning the micro-batch")
        held = list(kept.held)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        process.THIRD_PARTIES.held.clear()
    err = capfd.readouterr().err
    assert "generated new fontManager" not in err
    assert "WARNING matplotlib.font_manager: a font is missing" in err
    assert "INFO gradaccum.app: planning the micro-batch" in err
    assert len(held) == 1 and held[0].endswith(
        "matplotlib.font_manager INFO: generated new fontManager"
    )
