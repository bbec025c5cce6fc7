"""Shared by every test: the helpers (tests/helpers.py) are importable from any folder, and
each test is marked by its folder: ``unit`` (fast, in-process) or ``integration`` (CLI runs,
subprocesses, torchrun). Spawned worker processes inherit this sys.path."""

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# A private cache for the tests and every process they start (the extracted MiniLM,
# matplotlib's fonts, torch's compiled extensions): never the user's, never warm from an
# earlier run. One per run of pytest: its first process (xdist's controller) makes it, the
# workers it starts share it, and it is removed when that process ends.
if "GRADACCUM_TESTS_CACHE" not in os.environ:
    os.environ["GRADACCUM_TESTS_CACHE"] = tempfile.mkdtemp(prefix="gradaccum-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["GRADACCUM_TESTS_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["GRADACCUM_TESTS_CACHE"]
# Plans are measured afresh in every test (the tests of the plan cache give it a folder):
# a plan another test left would change what a test that plans sees.
os.environ["GRADACCUM_PLAN_CACHE"] = "off"
# Started under nohup, every process would inherit SIGHUP ignored, and the command rightly
# leaves an ignored signal alone: the tests of the stop signals expect a terminal's default
# (the respect of nohup has tests of its own, which ignore it themselves).
signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_collection_modifyitems(items):
    for item in items:
        kind = item.path.relative_to(HERE).parts[0]
        if kind in ("unit", "integration"):
            item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture
def one_process_group():
    """A process group of one (gloo on loopback), for the pipeline window's one stage."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
