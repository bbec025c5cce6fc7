"""The plan cache: the same command run again starts training at once instead of planning
again (planning measures memory for seconds to minutes).

A plan is kept under ``$XDG_CACHE_HOME/gradaccum/plans/`` (``~/.cache`` without it), one
JSON file per key; ``$GRADACCUM_PLAN_CACHE`` names another folder, or ``off`` turns the
cache off. The key is a hash of everything the plan depends on, all of it known before the
model is built or the data loaded (a cache hit costs what reading it costs): the recipe and
the options that shape its model and data (the run's configuration less what cannot change
memory: its length, cadences, output, learning rate), the files of ``--hf-model`` and
``--data`` (size and modification time), the per-rank effective batch, budget, margin,
meter, checkpointing, precision, the source of gradaccum itself (the recipes' models and the
planner), the device (a GPU's name and memory), the machine, its thread count, and the
versions of Python, torch and gradaccum. Anything else changed plans again. ``--replan``
plans again regardless (and stores the new plan).

An entry is trusted only whole: it carries the sha256 of its own contents, and the plan in
it must be one ``plan()`` makes for this request (positive sizes that add up to the batch
asked, its budget and settings the ones asked). Anything else (an edited or truncated
file, an entry without a checksum, a FIFO, a folder, a link to one) is named in one line on
stderr and planned over; a read that could block (a FIFO) never starts."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradaccum import __version__
from gradaccum.app.process import say
from gradaccum.planning import Plan

FORMAT = 3  # 3: keyed without the model (the code and the settings that build it)
_LARGEST = 16 * 2**20  # bytes: far above any plan's record; a larger file is not one
# the sizes plan() lays a window out in: each an integer >= 1
_SIZES = ("effective_batch", "world_size", "per_rank_batch", "micro_size", "micro_batches")
_SIZES += ("last_micro_size", "largest_fitting", "budget")


def folder() -> Path | None:
    """``$GRADACCUM_PLAN_CACHE`` (a folder, or ``off``), else ``$XDG_CACHE_HOME/gradaccum/plans``
    (``~/.cache`` without it)."""
    chosen = os.environ.get("GRADACCUM_PLAN_CACHE", "")
    if chosen.lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradaccum" / "plans"


def key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def signature(
    device: torch.device, settings: dict[str, Any], paths: tuple[str | None, ...] = ()
) -> dict[str, Any]:
    """What a plan depends on, as JSON, known without building the model or loading the
    data: ``settings`` are the plan's own arguments and the model's (the recipe and its
    options, or the run's configuration: budget, margin, meter, checkpointing, precision,
    effective batch, LoRA, ...); ``paths`` the files the model and data come from (size and
    modification time); the code that builds the recipes and plans (``code_digest``), the
    versions, the machine and the device. A setting that names one of ``paths`` is keyed
    by the path resolved: ``DIR`` and ``./DIR`` and its absolute path are one question."""
    resolved = {p: str(Path(p).resolve()) for p in paths if p is not None}
    settings = {k: resolved.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    return {
        "format": FORMAT,
        "versions": [platform.python_version(), torch.__version__, __version__],
        "code": code_digest(),
        "machine": [socket.gethostname(), platform.machine(), torch.get_num_threads()],
        "device": _device(device),
        "files": [_files(p) for p in paths if p is not None],
        **settings,
    }


def code_digest() -> str:
    """The sha256 of gradaccum's own source files (names and bytes): the recipes' models
    and data, the planner and the engine it measures. A changed line of any of them plans
    again; reading them takes milliseconds."""
    root = Path(__file__).resolve().parents[1]  # the gradaccum package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def load(
    parts: dict[str, Any], warn: Callable[[str], None] = say
) -> tuple[Plan, dict[str, Any], Path] | None:
    """The stored plan for ``parts``, or None: none stored, or an entry that is not a whole,
    consistent plan for ``parts`` (then ``warn`` gets one line naming the file and what is
    wrong with it, and the caller plans over it)."""
    if (where := folder()) is None:
        return None
    path = where / f"{key(parts)}.json"
    try:
        text = read_text(path)
        if text is None:
            return None
        plan, info = _entry(text, parts)
    except ValueError as err:
        warn(f"gradaccum: warning: the cached plan {path} {err}; planning over it")
        return None
    return plan, info, path


def checksum(body: dict[str, Any]) -> str:
    """The sha256 of an entry's body (``{"key": ..., "plan": ...}``) as canonical JSON."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def store(parts: dict[str, Any], info: dict[str, Any]) -> Path | None:
    """Keep ``info`` (a plan's ``to_dict()``) for ``parts`` with its checksum; written whole (a
    temporary file renamed), so a crash leaves no half file. A cache that cannot be written
    is skipped: the next run plans again."""
    if (where := folder()) is None:
        return None
    path = where / f"{key(parts)}.json"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    body = json.loads(json.dumps({"key": parts, "plan": info}))  # as it will read back
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**body, "sha256": checksum(body)}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None
    return path


def read_text(path: Path, largest: int = _LARGEST) -> str | None:
    """The file's text, None when there is none; ValueError (what is wrong) for anything
    but a readable regular file of UTF-8 text of at most ``largest`` bytes. The file's type
    is known before it is opened, and it is opened without blocking: a FIFO never holds the
    command. Every file the command reads that another program may have put there (a cache
    entry, a model's config.json) is read so."""
    try:
        before = os.stat(path)  # a link's target: what would be opened
    except FileNotFoundError:
        if os.path.lexists(path):
            raise ValueError("is a symbolic link to nothing") from None
        return None
    except OSError as err:
        raise ValueError(f"cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(before.st_mode):
        raise ValueError(f"is {_kind(before.st_mode)}, not a regular file")
    try:  # non-blocking too, should a FIFO replace the file between stat and open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ValueError(f"cannot be read ({err.strerror or err})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > largest:
            raise ValueError(f"is {st.st_size} bytes, more than the {largest} such a file has")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(largest + 1)
    except OSError as err:
        raise ValueError(f"cannot be read ({err.strerror or err})") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text (damaged)") from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "something other than a file"


def _entry(text: str, parts: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
    """The plan in an entry's text, checked whole; ValueError saying what is wrong."""
    try:
        stored = json.loads(text)
    except ValueError as err:
        raise ValueError(f"is not JSON (truncated or damaged: {err})") from None
    if not isinstance(stored, dict) or not {"key", "plan"} <= set(stored):
        raise ValueError("is not a plan cache entry (no key and plan)")
    if "sha256" not in stored:
        raise ValueError("has no checksum (an entry of an older gradaccum)")
    body = {"key": stored["key"], "plan": stored["plan"]}
    if stored["sha256"] != checksum(body):
        raise ValueError("does not match its checksum (edited or damaged)")
    if stored["key"] != parts:  # a hash collision, or an entry written for another request
        raise ValueError("was stored for another model or setting than this one")
    info = stored["plan"]
    if not isinstance(info, dict):
        raise ValueError("holds no plan")
    problems = _plan_problems(info, parts)
    if problems:
        raise ValueError("is not a valid plan: " + "; ".join(problems))
    try:  # its remaining fields and their types
        return Plan.from_dict(info), info
    except ValueError as err:
        raise ValueError(f"is not a valid plan: {err}") from None


def _plan_problems(info: dict[str, Any], asked: dict[str, Any]) -> list[str]:
    """Every way ``info`` (a plan's record) is not a plan ``plan()`` makes for the request
    ``asked`` (the cache key's settings): sizes that are not integers >= 1, a window that does
    not add up to the batch, a budget or setting other than the one asked."""
    out = []
    for name in _SIZES:
        value = info.get(name)
        if type(value) is not int or value < 1:
            out.append(f"{name} must be an integer >= 1, got {value!r}")
    if out:
        return out  # the arithmetic below reads them
    world, per_rank = info["world_size"], info["per_rank_batch"]
    micro_size, n, last = info["micro_size"], info["micro_batches"], info["last_micro_size"]
    if world * per_rank != info["effective_batch"]:
        out.append(
            f"effective_batch {info['effective_batch']} is not world_size {world} x "
            f"per_rank_batch {per_rank}"
        )
    if (
        n != math.ceil(per_rank / micro_size)
        or last > micro_size
        or (n - 1) * micro_size + last != per_rank
    ):
        out.append(
            f"{n} micro-batches of {micro_size} with a last one of {last} do not make "
            f"per_rank_batch {per_rank} (that is {math.ceil(per_rank / micro_size)} micro-batches, "
            f"the last of {per_rank - (math.ceil(per_rank / micro_size) - 1) * micro_size})"
        )
    elif "micro_sizes" in info and info["micro_sizes"] != [micro_size] * (n - 1) + [last]:
        out.append(f"micro_sizes {info['micro_sizes']!r} are not the window's")
    for phase in info.get("phases") or ():
        size = phase.get("micro_size") if isinstance(phase, dict) else None
        if type(size) is not int or size < 1:
            out.append(f"a phase's micro_size must be an integer >= 1, got {size!r}")
    peak = info.get("predicted_peak")
    if not isinstance(peak, (int, float)) or not 0 <= peak <= info["budget"]:
        out.append(f"predicted_peak {peak!r} is not within the budget {info['budget']}")
    for name in ("effective_batch", "budget", "margin", "precision", "world_size"):
        if name in asked and info.get(name) != asked[name]:
            out.append(f"{name} {info.get(name)!r} is not the {asked[name]!r} asked")
    return out


def _device(device: torch.device) -> list[Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return [str(device), props.name, props.total_memory]
    return [str(device)]


def _files(path: str) -> list[Any]:
    """A file, or a folder's files, as (name, size, modification time): what was read."""
    root = Path(path).resolve()
    found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out: list[Any] = [str(root)]
    for p in found[:10_000]:
        st = p.stat()
        out.append([str(p.relative_to(root)) if p != root else "", st.st_size, st.st_mtime_ns])
    return out
