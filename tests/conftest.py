"""Shared by every test: the helpers (tests/helpers.py) are importable from any folder, and
each test is marked by its folder: ``unit`` (fast, in-process) or ``integration`` (CLI runs,
subprocesses, torchrun). Spawned worker processes inherit this sys.path."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# A private cache for the tests and every process they start (the plan cache, the extracted
# MiniLM): never the user's, never warm from an earlier run; removed when the tests end.
_CACHE = tempfile.mkdtemp(prefix="gradaccum-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


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
