"""The command's stop and run-folder messages that only a real process shows (issue 43,
"nothing silent"): a signal and an exit status."""

import signal

import pytest
from test_failed_starts import _planning
from test_faults import start


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)]
)
def test_sigterm_or_sighup_while_planning_is_a_failed_start_said_in_one_line(tmp_path, signum):
    """As Ctrl-C there: the folder it made removed, one line, 128 + N. Before, SIGTERM
    ended the process where it stood, leaving .lock and config.json and saying nothing."""
    # long enough that a signal sent late still finds it running (and says where it was)
    planned = ["train", "--recipe", "digits", "--effective-batch", 16, "--steps", 500]
    run = tmp_path / "run"
    proc = start(*planned, "--out", run)
    _planning(run, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == f"gradaccum: stopped by {name}", err
    assert "Traceback" not in err
    assert not run.exists()  # it made the folder: it is gone
