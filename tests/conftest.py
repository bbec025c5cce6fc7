"""Shared by every test: the helpers (tests/helpers.py) are importable from any folder, and
each test is marked by its folder: ``unit`` (fast, in-process) or ``integration`` (CLI runs,
subprocesses, torchrun). Spawned worker processes inherit this sys.path."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pytest_collection_modifyitems(items):
    for item in items:
        kind = item.path.relative_to(HERE).parts[0]
        if kind in ("unit", "integration"):
            item.add_marker(getattr(pytest.mark, kind))
