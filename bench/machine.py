"""One line describing the machine a result came from, for every results file."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch


def describe(threads: int | None = None, peers: bool = False) -> str:
    """``x86_64, 2 cores, 2 torch threads, torch 2.13.0+cpu, Python 3.11.7`` (and the
    versions of Accelerate and Lightning when ``peers``)."""
    threads = torch.get_num_threads() if threads is None else threads
    parts = [
        platform.machine(),
        f"{os.cpu_count()} cores",
        f"{threads} torch threads per process",
        f"torch {torch.__version__}",
    ]
    if peers:
        import accelerate
        import lightning

        parts += [f"accelerate {accelerate.__version__}", f"lightning {lightning.__version__}"]
    parts.append(f"Python {sys.version.split()[0]}")
    return "Machine: " + ", ".join(parts) + "."


def commit() -> str:
    """The short hash of the checkout a result came from ("unknown" outside git)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"
