"""`gradaccum plan --device cuda` without a GPU (or with ``--estimate``): the fake-tensor
estimate of a recipe or a Hugging Face config, in a process of its own.

The trace runs in a process of its own, so that an op torch cannot fake, or an abort inside
torch, ends in one line and never takes the command down: forked from the command where it
can fork (``_Forked``, torch already imported), else ``python -m gradaccum.app.estimating``;
the same ``main`` either way. The request goes
in on its stdin, the answer comes back on its stdout, progress on its stderr: no file is
written, so a parent killed outright leaves no folder, and the child, whose stdin then
closes, ends at once. A trace that runs past ``--trace-limit`` is stopped, naming the layer
it was at.

With ``--micro-batch`` it estimates that size; otherwise the largest micro-batch whose
device total fits the budget (a window of two micro-batches peaks as one of any larger
number: from the second on, every buffer the window holds is there), and the micro-batches
per window that make ``--effective-batch``. The whole model is traced at sizes 1, 2 and 3
side by side (processes forked from this one), and every size from 2 up is read off the
traces at 2 and 3 (``gradaccum.planning.estimate.stream``: the same allocations at both, each
constant or in proportion to the size), so the answer is a trace of the model asked or
what that trace would give. Where the two do not show the other sizes, a model of identical
repeated blocks (a transformer's layers) is first traced with 2 and 3 of them: the
allocated bytes of the whole model are those two traces' line through the layer count,
which guesses the size that fits; the whole model is then traced at that size (and its
neighbours, until the largest that fits is known). Every trace is kept in the estimate
cache, so a question that differs in budget, micro-batch or effective batch alone traces
only what it has not seen, and one that needs no trace at all is answered without the
trace process (``_Search(trace=False)`` in the command).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gradaccum.app import plan_cache
from gradaccum.app.config import PlanConfig
from gradaccum.app.process import say
from gradaccum.batching import largest_share
from gradaccum.memory import format_bytes, parse_bytes

__all__ = ["config_problems", "estimate_command", "head_loss", "main", "render", "task_of"]


# what only says how to print a plan, or how long to wait for it: the same estimate
_NOT_KEYED = ("json", "plot", "replan", "export", "export_to", "meter", "margin", "prefer")
_NOT_KEYED += ("trace_limit",)
# what a window's traces do not depend on, or are keyed by (the length and checkpointing,
# in each workload's key): a question differing only in these reuses them
_NOT_TRACED = ("budget", "micro_batch", "effective_batch", "checkpointing", "seq_len")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
_PROGRESS = "progress: "  # the child's stderr lines that are progress, said as they come
_EVERY = 5.0  # seconds between progress lines within one trace
_QUIET = 2.0  # seconds into a trace before it is said (a small model's say nothing)


def config_problems(cfg: PlanConfig) -> list[str]:
    """Every problem of ``--hf-model``'s config.json that would otherwise end a trace (or
    run one for a model that cannot be): the checks every command makes
    (``recipes.hf_config_problems``), and fewer positions than ``--seq-len``. Read without
    transformers."""
    if cfg.hf_model is None:
        return []
    from gradaccum.app.recipes import hf_config_file, hf_config_problems

    path = hf_config_file(cfg.hf_model)
    data, out = hf_config_problems(path)
    if data is None:
        return [f"--hf-model {problem}" for problem in out]
    positions = [data[n] for n in _POSITIONS if type(data.get(n)) is int and data[n] >= 1]
    if positions and cfg.seq_len is not None and cfg.seq_len > min(positions):
        out.append(
            f"--seq-len {cfg.seq_len} is longer than the model's {min(positions)} positions "
            f"({path})"
        )
    return out


def estimate_command(cfg: PlanConfig) -> dict[str, Any]:
    """The estimate's result (``Estimate.to_dict()``, the search and, where nothing fits,
    the alternatives): the plan cache's when it holds this estimate (``cached``: its file),
    else traced in its own process and stored; a ValueError with one line when the trace
    fails or the config cannot be traced."""
    if problems := config_problems(cfg):
        raise ValueError("; ".join(problems))
    cfg, quantized = _quantization_of(cfg)
    parts = _cache_key(cfg)
    if not cfg.replan and (found := _cached(parts)) is not None:
        return found
    traces_key = _cache_key(cfg, traces=True)
    known = {} if cfg.replan else (_cached(traces_key, quiet=True) or {}).get("traces", {})
    answer = None
    if known:  # an earlier question's traces may answer this one: then no process, no trace
        search = _Search(cfg, known, trace=False)
        try:
            answer = {"estimate": search.run(), "traces": search.traces}
        except (ValueError, TypeError) as err:  # as the process would say it
            answer = {"error": str(err).splitlines()[0], "traces": search.traces}
        except _Untraced:
            pass
    if answer is None:
        answer = _traced(cfg, known)
    if answer.get("traces"):
        plan_cache.store(traces_key, {"traces": answer["traces"]})
    if "error" in answer:
        raise ValueError(answer["error"])
    if quantized:
        answer["estimate"]["assumptions"].insert(0, quantized)
    plan_cache.store(parts, answer["estimate"])
    return {**answer["estimate"], "cached": None}


# bitsandbytes' 4-bit kinds, as its quantization_config names them
_BNB_4BIT = ("nf4", "fp4")


def _gptq_group(cfg: PlanConfig) -> int:
    """The GPTQ group size --hf-model's quantization_config names (auto-gptq's 128 if none)."""
    from gradaccum.app.recipes import hf_config_file
    from gradaccum.planning.estimate.quantized import GPTQ_GROUP

    if cfg.hf_model is None:
        return GPTQ_GROUP
    data = json.loads(plan_cache.read_text(hf_config_file(cfg.hf_model)) or "{}")
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    group = quant.get("group_size") if isinstance(quant, dict) else None
    return group if isinstance(group, int) else GPTQ_GROUP


def _quantization_of(cfg: PlanConfig) -> tuple[PlanConfig, str | None]:
    """``cfg`` with the base quantized as ``--hf-model``'s config.json says
    (``quantization_config``, as transformers' ``from_pretrained`` applies it), and the line
    that says so; ``cfg`` itself where it says nothing. bitsandbytes' 4-bit and 8-bit bases
    are modelled (``--quantize`` given too must agree); any other method is refused in one
    line: estimating the model unquantized would not be this model's memory."""
    if cfg.hf_model is None:
        return cfg, None
    from gradaccum.app.recipes import hf_config_file

    path = hf_config_file(cfg.hf_model)
    data = json.loads(plan_cache.read_text(path) or "{}")
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    if quant is None:
        return cfg, None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "gptq" and quant.get("bits") == 4:
        if cfg.quantize not in (None, "gptq"):
            raise ValueError(
                f"--quantize {cfg.quantize} disagrees with --hf-model's quantization_config "
                f"(GPTQ 4-bit, in {path}): give the config's, or none"
            )
        if cfg.lora is None:
            raise ValueError(
                f"--hf-model {path}: its quantization_config quantizes the base (GPTQ 4-bit), "
                "which trains adapters only: add --lora R (or an adapter_config.json)"
            )
        said = (
            f"quantization: GPTQ 4-bit, group size {_gptq_group(cfg)}, as --hf-model's "
            "config.json's quantization_config says"
        )
        return dataclasses.replace(cfg, quantize="gptq", double_quant=False), said
    if method != "bitsandbytes":
        what = f"{method}" if isinstance(method, str) else "of no quant_method"
        bits = quant.get("bits") if isinstance(quant, dict) else None
        group = quant.get("group_size") if isinstance(quant, dict) else None
        shape = ", ".join(x for x in (bits and f"{bits}-bit", group and f"group size {group}") if x)
        raise ValueError(
            f"--hf-model {path}: its quantization_config is {what}"
            + (f" ({shape})" if shape else "")
            + ", whose packed layers the estimate does not model (it models bitsandbytes' "
            "nf4, fp4 and 8-bit bases and GPTQ 4-bit); estimating it unquantized would not be "
            "this model's memory. Remove quantization_config from a copy of config.json to "
            "estimate the model unquantized"
        )
    if quant.get("load_in_4bit"):
        kind = str(quant.get("bnb_4bit_quant_type", "fp4"))
        double = bool(quant.get("bnb_4bit_use_double_quant", False))
    elif quant.get("load_in_8bit"):
        kind, double = "8bit", False
    else:
        return cfg, None  # bitsandbytes, loading neither way: the base as it is
    if kind not in (*_BNB_4BIT, "8bit"):
        raise ValueError(
            f"--hf-model {path}: its quantization_config's bnb_4bit_quant_type is {kind!r}, "
            f"expected one of {', '.join(_BNB_4BIT)}"
        )
    if cfg.quantize is not None and (cfg.quantize, cfg.double_quant) != (kind, double):
        raise ValueError(
            f"--quantize {cfg.quantize}{' --double-quant' if cfg.double_quant else ''} "
            f"disagrees with --hf-model's quantization_config (bitsandbytes {kind}"
            f"{', double quantization' if double else ''}, in {path}): give the config's, or "
            "none"
        )
    if cfg.lora is None:
        raise ValueError(
            f"--hf-model {path}: its quantization_config quantizes the base (bitsandbytes "
            f"{kind}), which trains adapters only: add --lora R (or an adapter_config.json)"
        )
    said = (
        f"quantization: bitsandbytes {kind}{' with double quantization' if double else ''}, "
        f"as --hf-model's config.json's quantization_config says"
    )
    return dataclasses.replace(cfg, quantize=kind, double_quant=double), said


def _cache_key(cfg: PlanConfig, traces: bool = False) -> dict[str, Any]:
    """What the estimate depends on, known before anything is built: the settings, the
    --hf-model folder's files (and --lora's adapter config), gradaccum's source, the
    versions (transformers' too: its classes are the model), the machine. ``traces``: the
    key of the window traces, which the budget and the batch sizes do not change."""
    import torch

    left = _NOT_KEYED + (_NOT_TRACED if traces else ())
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in left}
    settings = {"kind": "estimate traces" if traces else "estimate", **settings}
    if cfg.hf_model is not None:
        import importlib.metadata

        settings["transformers"] = importlib.metadata.version("transformers")
    lora = cfg.lora if cfg.lora is not None and not cfg.lora.isdigit() else None
    return plan_cache.signature(torch.device("cpu"), settings, (cfg.hf_model, lora, cfg.deepspeed))


def _cached(parts: dict[str, Any], quiet: bool = False) -> dict[str, Any] | None:
    """The stored estimate for ``parts``, or None; an entry that is not whole (its checksum),
    not for these settings, or not an estimate's record is said in one line and estimated
    over. Read as the plan cache reads its entries: a regular file only, never a read that
    blocks, never a file larger than any entry."""
    where = plan_cache.folder()
    path = None if where is None else where / f"{plan_cache.key(parts)}.json"
    if path is None:
        return None
    started = time.perf_counter()
    try:
        text = plan_cache.read_text(path)
        if text is None:
            return None
        entry = json.loads(text)
        if not isinstance(entry, dict):
            raise ValueError("is not a cache entry")
        body = {"key": entry.get("key"), "plan": entry.get("plan")}
        if entry.get("sha256") != plan_cache.checksum(body) or body["key"] != parts:
            raise ValueError("does not match its checksum or these settings")
        if problems := _record_problems(body["plan"]):
            raise ValueError("is not an estimate: " + "; ".join(problems))
    except ValueError as err:
        say(f"gradaccum: warning: the cached estimate {path} {err}; estimating over it")
        return None
    if not quiet:
        took = time.perf_counter() - started
        say(f"the estimate is the cached one ({path}, read in {took:.2f} s; --replan "
            "estimates again)")  # fmt: skip
    return {**body["plan"], "cached": str(path)}


def _record_problems(record: Any) -> list[str]:
    """What is wrong with a stored estimate (or a stored set of traces): its sizes and
    byte counts must be integers in range, its parts a table of them."""
    if not isinstance(record, dict):
        return ["holds no record"]
    if "traces" in record:
        traces = record["traces"]
        if not isinstance(traces, dict):
            return ["its traces are not a table"]
        out = []
        for key, t in traces.items():
            if key.endswith("|workload"):
                if not isinstance(t, dict) or set(t) != set(_DESCRIBED):
                    out.append(f"{key} is not a workload's record")
                elif not isinstance(t["assumed"], list) or not all(
                    x is None or type(x) is int for x in (t["layers"], t["positions"], t["length"])
                ):
                    out.append(f"{key} is not a workload's record")
            else:
                out += _record_problems(t)
        return out[:3]
    out = []
    for name in ("allocated", "reserved", "total"):
        value = record.get(name)
        if type(value) is not int or value < 0:
            out.append(f"{name} must be a byte count, got {value!r}")
    size = record.get("micro_batch", record.get("micro_size"))
    if type(size) is not int or size < 1:
        out.append(f"micro_batch must be an integer >= 1, got {size!r}")
    parts = record.get("parts")
    if not isinstance(parts, dict) or any(type(v) is not int for v in parts.values()):
        out.append("parts must be a table of byte counts")
    if not isinstance(record.get("assumptions", []), list):
        out.append("assumptions must be a list")
    if record.get("stream") is not None:
        from gradaccum.planning.estimate.stream import Stream

        try:
            Stream.from_dict(record["stream"])
        except ValueError as err:
            out.append(str(err))
    return out


def _traced(cfg: PlanConfig, known: dict[str, Any]) -> dict[str, Any]:
    """The child's answer: ``{"estimate": ..., "traces": ...}`` or ``{"error": one line,
    "traces": ...}``. Its progress lines are said as they come; a child past the limit, or
    one the user stops, is killed before this returns or raises."""
    request = json.dumps({"config": dataclasses.asdict(cfg), "known": known})
    child = (
        _Forked()
        if _can_fork()
        else subprocess.Popen(
            [sys.executable, "-m", "gradaccum.app.estimating"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    said: list[str] = []  # the child's last lines, progress or not

    def relay() -> None:
        for line in child.stderr:
            line = line.rstrip("\n")
            if line.startswith(_PROGRESS):
                say(line[len(_PROGRESS) :])
            said[:] = [*said[-20:], line]

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    answer: list[str] = []
    collector = threading.Thread(target=lambda: answer.append(child.stdout.read()), daemon=True)
    collector.start()
    try:
        child.stdin.write(request + "\n")
        child.stdin.flush()  # stdin stays open: the child ends when it closes
        child.wait(timeout=cfg.trace_limit)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        where = next((s[len(_PROGRESS) :] for s in reversed(said) if s.startswith(_PROGRESS)), "")
        raise ValueError(
            f"the memory trace did not finish within --trace-limit {cfg.trace_limit:g} s "
            f"(stopped{'; ' + where if where else ' before its first layer'}); a larger limit "
            "waits longer, --micro-batch N traces one size"
        ) from None
    except BaseException:  # Ctrl-C, a stop signal: the trace ends with the command
        child.kill()
        child.wait()
        raise
    finally:
        with contextlib.suppress(OSError):
            child.stdin.close()
    collector.join()
    reader.join(timeout=5)
    lines = (answer[0] if answer else "").strip().splitlines()
    if lines:
        with contextlib.suppress(ValueError):
            return json.loads(lines[-1])
    last = next((s for s in reversed(said) if not s.startswith(_PROGRESS)), "no output")
    code = child.returncode
    how = f"signal {-code}" if code < 0 else f"exit {code}"
    raise ValueError(f"the memory trace's process ended ({how}) without an estimate: {last}")


class _Forked:
    """The estimating process forked from the command (where it can fork), not started
    afresh: it has torch and gradaccum imported already, a second of a neighbouring
    question's ten. It is what ``python -m gradaccum.app.estimating`` is (``main``, its
    stdin, stdout and stderr pipes to this process, every other file closed, the signals'
    own handlers, dying with its parent), behind ``subprocess.Popen``'s few members that
    ``_traced`` uses."""

    def __init__(self) -> None:
        import signal

        pipes = [os.pipe() for _ in range(3)]  # (read, write) of stdin, stdout, stderr
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        # held back across the fork: a signal that came before the child had its own
        # handlers would run the command's in it
        held = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        self.pid = os.fork()
        if self.pid == 0:  # the child: main() and gone, never back into the command
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
                for fd, (read, write) in enumerate(pipes):
                    os.dup2(read if fd == 0 else write, fd)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                _die_with_parent()
                code = main([])
            except SystemExit as end:
                code = end.code if isinstance(end.code, int) else 1
            except BaseException:  # noqa: BLE001 (said on its stderr, as a new process would)
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        for fd, (read, write) in enumerate(pipes):
            os.close(write if fd else read)
        self.stdin = os.fdopen(pipes[0][1], "w")
        self.stdout = os.fdopen(pipes[1][0])
        self.stderr = os.fdopen(pipes[2][0])
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG if deadline else 0)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("the estimating process", timeout)
            else:
                time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)


def render(result: dict[str, Any], budget: int | None, said: str | None = None) -> list[str]:
    """The estimate for a person: the summary, what it assumed, the table of parts, and
    where nothing fits, what would (each change not already made, with its own number)."""
    fits = ""
    if budget is not None:
        word = "fits" if result["total"] <= budget else "does not fit"
        fits = f"; {word} the budget ({said or format_bytes(budget)})"
    lines = [
        f"ESTIMATE for {result['gpu']} (traced with fake tensors on this machine, not "
        f"measured): micro-batch {result['micro_batch']} x {result['per_window']} per window"
        f"{fits}",
    ]
    if result.get("largest"):
        lines.append(f"largest micro-batch that fits: {result['largest']}")
    if result.get("band"):
        from gradaccum.planning.estimate.band import line

        lines.append(line(result["band"], result["total"], budget))
    if "longest" in result:
        longest = result["longest"]
        lines.append(
            f"longest sequence that fits at micro-batch {result['micro_batch']}: {longest} "
            f"tokens (of the model's {result['positions']} positions)"
            if longest
            else f"no sequence fits at micro-batch {result['micro_batch']}"
        )
    lines += [f"checkpointing: {line}" for line in result.get("checkpointing_said", ())]
    lines += [f"assumed: {a}" for a in result["assumptions"]]
    rows = [("allocated (max_memory_allocated)", result["allocated"])]
    rows += [(f"  {name}", size) for name, size in result["parts"].items()]
    rows += [
        ("reserved (max_memory_reserved)", result["reserved"]),
        ("  CUDA context (assumed)", result["context"]),
        *([("  paged optimizer state", result["unified"])] if result.get("unified") else []),
        ("device total (nvidia-smi)", result["total"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines += ["", *(f"{name:<{width}}  {format_bytes(size):>10}" for name, size in rows)]
    if result.get("alternatives"):
        lines += ["", "what would change it (micro-batch 1, each change alone):"]
        for alt in result["alternatives"]:
            word = "fits" if budget is not None and alt["total"] <= budget else "does not fit"
            how = "" if alt["traced"] else " (from 2- and 3-block traces)"
            lines.append(f"  {alt['flag']}: {format_bytes(alt['total'])}, {word}{how}")
    return lines


# ----- the estimating process --------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m gradaccum.app.estimating``: reads ``{"config": ..., "known": ...}`` as
    one line on stdin, writes ``{"estimate": ..., "traces": ...}`` or ``{"error": one line,
    "traces": ...}`` as one line on stdout, progress on stderr; ends when stdin closes (its
    parent gone). Not a command: ``estimate_command`` runs it."""
    argparse.ArgumentParser(prog="python -m gradaccum.app.estimating").parse_args(argv)
    from gradaccum.app.process import EXIT_ORPHANED, exit_on_end_of_input, quiet_third_parties

    line = sys.stdin.readline()
    if not line:  # the command ended (or had no use for it) before asking
        return EXIT_ORPHANED
    request = json.loads(line)
    exit_on_end_of_input()
    quiet_third_parties()
    from gradaccum.planning.estimate.trace import TraceError

    cfg = PlanConfig(**request["config"])
    search = _Search(cfg, request.get("known") or {})
    try:
        result = search.run()
    except (TraceError, ValueError, TypeError) as err:
        answer = {"error": str(err).splitlines()[0], "traces": search.traces}
    except Exception as err:  # noqa: BLE001 (any failure of a trace is one line, named)
        first = (str(err).strip().splitlines() or [""])[0][:200]
        answer = {
            "error": f"the memory trace failed in {search.progress.where}: "
            f"{type(err).__name__}: {first}",
            "traces": search.traces,
        }
    else:
        answer = {"estimate": result, "traces": search.traces}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


class _Progress:
    """Where the estimate is, said on stderr every few seconds once a step has taken more
    than a couple: the model being built, or the trace and the module whose forward runs (a
    checkpointed block's recomputation in backward included). A small model says nothing,
    and neither does a search that traces nothing (``active=False``).

    Said from the tracing thread itself, as each module's forward begins (and by ``tick``
    where the process waits): no thread of its own. A second thread that allocates runs
    Python's collector there, which frees the trace's fake tensors off the thread that is
    dispatching on them (a trace process ended in a segmentation fault so)."""

    def __init__(self, active: bool = True) -> None:
        self.label, self.where = "the estimate", "starting"
        self.started = self._last = time.monotonic()
        self.names: dict[int, str] = {}
        if active:
            import torch

            torch.nn.modules.module.register_module_forward_pre_hook(self._entered)

    def watch(self, model: Any) -> Any:
        self.names = {
            id(m): f"{n or 'model'} ({type(m).__name__})" for n, m in model.named_modules()
        }
        self.where = "the first forward"
        return model

    def step(self, label: str, where: str | None = "building the model") -> None:
        self.label, self.where = label, where
        self.started = time.monotonic()
        self._last = self.started - _EVERY + _QUIET  # its first line after _QUIET s

    def _entered(self, module: Any, _args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.where = name
        self.tick()

    def tick(self) -> None:
        """The line, when one is due."""
        now = time.monotonic()
        if now - self._last >= _EVERY:
            self._last = now
            at = f": at {self.where}" if self.where else ""
            sys.stderr.write(f"{_PROGRESS}{self.label}{at}, {now - self.started:.0f} s\n")
            sys.stderr.flush()


def _can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def _die_with_parent() -> None:
    """This process killed when its parent ends (Linux's PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent ended before the call: end now
            os._exit(1)


class _Untraced(Exception):
    """A trace the search needs and may not make (``_Search(trace=False)``)."""


# the changes a refusal weighs, each where it is not already made: (flag, the change, when)
_RECOMPUTE_COST = (
    "it recomputes each block's forward in backward: about a third more compute per step"
)


class _Search:
    """The estimate's questions, each answered by as few traces as it can (see the module's
    docstring); ``traces`` holds every trace made or reused, for the cache."""

    def __init__(self, cfg: PlanConfig, known: dict[str, Any], trace: bool = True) -> None:
        self.cfg = cfg
        self.traces: dict[str, Any] = dict(known)
        self.tracing = trace  # False: answer from ``known`` alone, or raise _Untraced
        self.progress = _Progress(active=trace)
        self.budget = parse_bytes(cfg.budget)
        self.per_rank = largest_share(cfg.effective_batch, cfg.world_size)
        self.syncs = ("window", "micro") if cfg.shard == "fsdp" else ("window",)
        self._estimates: dict[int, tuple[dict, Any]] = {}  # id -> (trace, parsed): _parsed

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        modes = {"off": (False,), "on": (True,), "auto": (False, True)}[cfg.checkpointing]
        self.progress.step("comparing the model's blocks (built on the meta device)", None)
        if cfg.longest:
            return self.longest_sequence(_Workload(cfg, modes[0], self.traces))
        work = {ck: _Workload(cfg, ck, self.traces, self.tracing) for ck in modes}
        found: dict[bool, tuple[int, dict[str, Any]] | None] = {}
        for ck in modes:
            found[ck] = None
            for sync in self.syncs:
                if cfg.micro_batch is not None:
                    est = self.full(work[ck], cfg.micro_batch, sync)
                    got = (cfg.micro_batch, est) if est["total"] <= self.budget else None
                else:
                    got = self.largest(work[ck], sync)
                if got is not None:
                    found[ck] = got
                    break
        chosen = next((ck for ck in modes if found[ck] is not None), modes[-1])
        w = work[chosen]
        if found[chosen] is not None:
            micro, est = found[chosen]
        else:
            micro = cfg.micro_batch or 1
            est = self.full(w, micro, self.syncs[-1])
        result = {k: v for k, v in est.items() if k != "stream"}
        result["per_window"] = math.ceil(self.per_rank / micro)
        result["largest"] = micro if cfg.micro_batch is None and found[chosen] else None
        result["budget"] = self.budget
        result["checkpointing"] = chosen
        result["checkpointing_said"] = self._checkpointing_said(modes, found, chosen)
        assumed = list(w.assumed)
        if est.get("sync") == "micro":
            assumed.append(
                "gradient sync micro, as the plan would choose: holding the whole unsharded "
                "gradient between micro-batches (window) does not fit the budget"
            )
        if cfg.optimizer in _OPTIMIZER_ASSUMED:
            assumed.append(f"optimizer: {_OPTIMIZER_ASSUMED[cfg.optimizer]}")
        pair = self._pair(w, est.get("sync") or "window", est["per_window"])
        if cfg.micro_batch is None and pair is not None:
            assumed.append(
                f"sizes from 2 up read off the whole model's traces at {pair[0]['micro_batch']}"
                f" and {pair[1]['micro_batch']} (the same allocations at both, each of the "
                "same bytes or in proportion to the micro-batch), replayed, not traced"
            )
        elif w.layers is not None and cfg.micro_batch is None:
            assumed.append(
                f"the size searched with 2- and 3-block traces of its {w.layers} identical "
                "blocks, then the whole model traced at the sizes that decide"
            )
        lengthened = {
            t["lengthened"]
            for k, t in self.traces.items()
            if k.startswith(f"{w.key}|") and t.get("lengthened")
        }
        if lengthened:
            assumed.append(
                f"the whole model's traces at {w.length} tokens read off those at "
                f"{', '.join(map(str, sorted(lengthened)))} and its 2-block model's at both "
                "lengths (each allocation changed as the same op's tensor of the same shape "
                "changed in the smaller model), not traced"
            )
        result["assumptions"] = assumed + list(est["assumptions"])
        if est["total"] > self.budget and cfg.micro_batch is None:  # nothing fits: what would
            result["alternatives"] = self.alternatives(w)
        return result

    def longest_sequence(self, asked: _Workload) -> dict[str, Any]:
        """The longest sequence (a multiple of 8, up to the model's positions) whose window
        fits the budget at ``--micro-batch`` (1 by default): searched as the micro-batch is
        (the 2- and 3-block line where the blocks are identical), decided by whole-model
        traces."""
        cfg, micro, sync = self.cfg, self.cfg.micro_batch or 1, self.syncs[0]
        if asked.positions is None:
            raise ValueError("--longest needs the model's positions (max_position_embeddings)")
        step = 8 if asked.positions >= 64 else 1
        work: dict[int, _Workload] = {}

        def at(length: int, whole: bool) -> float:
            if length not in work:
                change = dataclasses.replace(cfg, seq_len=length, longest=False)
                work[length] = _Workload(change, asked.checkpointing, self.traces, self.tracing)
            w = work[length]
            if whole or w.layers is None:
                return self.full(w, micro, sync)["total"]
            return self.predictor(w, sync, sizes=(micro,))(micro)

        # as the micro-batch is searched, in steps of ``step`` tokens
        fits = self._decide(
            lambda n: at(n * step, False), lambda n: at(n * step, True), asked.positions // step
        )
        length = max(fits, 1) * step
        est = self.full(work[length], micro, sync)
        result = {k: v for k, v in est.items() if k != "stream"}
        result.update(
            per_window=math.ceil(self.per_rank / micro),
            largest=None,
            budget=self.budget,
            checkpointing=asked.checkpointing,
            longest=length if est["total"] <= self.budget else None,
            positions=asked.positions,
        )
        result["assumptions"] = work[length].assumed + list(est["assumptions"])
        return result

    @staticmethod
    def _checkpointing_said(modes, found, chosen) -> list[str]:
        if len(modes) < 2:
            return []

        def said(ck: bool) -> str:
            got = found[ck]
            name = "with" if ck else "without"
            if got is None:
                return f"{name} it, not even a micro-batch of 1 fits"
            return f"{name} it, up to micro-batch {got[0]} ({format_bytes(got[1]['total'])})"

        lines = [said(False), said(True)]
        if found[False] is not None:
            lines.append("chosen: without (it fits: nothing to recompute)")
        elif found[True] is not None:
            lines.append(f"chosen: with; {_RECOMPUTE_COST}")
        return lines

    # -- the traces ------------------------------------------------------------------------

    def _windows(self, micro: int) -> int:
        return min(math.ceil(self.per_rank / micro), 2)

    def full(self, w: _Workload, micro: int, sync: str) -> dict[str, Any]:
        """The whole model's window at ``micro``: traced, or read off two traces of it at
        other sizes (``gradaccum.planning.estimate.stream``)."""
        key = self._key(w, micro, sync, None)
        if key not in self.traces and micro >= 2:
            pair = self._pair(w, sync, self._windows(micro))
            if pair is not None:
                from gradaccum.planning.estimate.estimator import at_size

                a, b = (self._parsed(t) for t in pair)
                read = at_size(a, b, micro)
                if read is not None:
                    self.traces[key] = {**read.to_dict(), "stream": None, "read": True}
        if key not in self.traces:
            self._lengthened(w, micro, sync)
        return self._trace(w, micro, sync, None)

    def _earlier(self, w: _Workload, sync: str, micro: int | None = None) -> _Workload | None:
        """``w`` at another sequence length whose whole-model trace (at ``micro``, or at any
        of 1-3) keeps its sequence: what ``w`` may be read off. None where there is none,
        or ``w`` is not made of identical blocks."""
        if w.layers is None or self.cfg.longest:
            return None
        mine = w.key.split("|")
        for size in (micro,) if micro else (1, 2, 3):
            suffix = f"|{sync}|micro {size} x {self._windows(size)}|all blocks"
            for key, whole in self.traces.items():
                other = key[: -len(suffix)].split("|") if key.endswith(suffix) else []
                if len(other) != len(mine) or not whole.get("stream"):
                    continue
                if whole.get("read") or whole.get("lengthened"):
                    continue
                differs = [i for i, (a, b) in enumerate(zip(other, mine, strict=True)) if a != b]
                if differs == [_LENGTH_FIELD] and other[_LENGTH_FIELD].isdigit():
                    change = dataclasses.replace(self.cfg, seq_len=int(other[_LENGTH_FIELD]))
                    return _Workload(change, w.checkpointing, self.traces)
        return None

    def _lengthened(self, w: _Workload, micro: int, sync: str) -> None:
        """The whole model's window at ``micro`` read off its trace at another sequence
        length (an earlier question's) and its 2-block model's traces at both lengths
        (``estimator.at_length``), where the model is made of identical blocks and such a
        trace is kept; kept as a trace, so that other sizes are read off it as off one."""
        earlier = self._earlier(w, sync, micro)
        if earlier is None:
            return
        from gradaccum.planning.estimate.estimator import at_length

        length = earlier.length
        self.progress.step(
            f"reading micro-batch {micro} at {w.length} tokens off the traces at {length}"
        )
        whole = self.traces[self._key(earlier, micro, sync, None)]
        before = self._trace(earlier, micro, sync, 2)
        after = self._trace(w, micro, sync, 2)
        # at 2 and 3, the other size's traces at the earlier length tell apart what grows
        # with the micro-batch from what has the same shape and does not
        pair = []
        other = self.traces.get(self._key(earlier, 5 - micro, sync, None))
        if micro in (2, 3) and other and other.get("stream") and not other.get("read"):
            pair = [other, self._trace(earlier, 5 - micro, sync, 2)]
        try:
            estimates = [self._parsed(t) for t in (whole, before, after, *pair)]
        except ValueError:
            return
        read = at_length(*estimates[:3], others=tuple(estimates[3:]) or None)
        if read is not None:
            self.traces[self._key(w, micro, sync, None)] = {
                **read.to_dict(),
                "steady": False,
                "lengthened": length,
            }

    def _at_once(self, w: _Workload, sync: str, sizes: tuple[int, ...]) -> None:
        """The whole model traced at each of ``sizes`` not yet traced, side by side
        (``_side_by_side``)."""
        self._side_by_side([(w, m, None) for m in sizes], sync)

    def _side_by_side(self, jobs: list[tuple[_Workload, int, int | None]], sync: str) -> None:
        """Each ``(workload, micro-batch, blocks)`` not yet traced (``blocks`` None: the
        whole model), in processes of their own running side by side (forked from this
        one, with everything it has imported and built; each killed with it): a trace is
        one core's work. Where the machine has one core, or cannot fork, or a process
        fails, the traces are left to be made one by one."""
        todo = [j for j in jobs if self._key(j[0], j[1], sync, j[2]) not in self.traces]
        if len(todo) < 2 or (os.cpu_count() or 1) < 2 or not self.tracing or not _can_fork():
            return
        todo = [(w.ready(), micro, layers) for w, micro, layers in todo]
        whole = [m for w, m, layers in todo if layers is None]
        if whole:
            w = todo[0][0]
            windows = {self._windows(m) for m in whole}
            what = (
                f"micro-batches {', '.join(map(str, whole))} x "
                f"{'/'.join(map(str, windows))}, the whole model"
            )
        else:
            what = f"{len(todo)} traces of the {todo[0][2]}-block model"
        self.progress.step(
            f"tracing {what}{', checkpointed' if todo[0][0].checkpointing else ''}, side by side",
            None,
        )
        children = []
        sys.stderr.flush()  # nothing buffered is written twice
        for w, micro, layers in todo:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one trace, its record written back, then gone
                os.close(read)
                _die_with_parent()
                self.progress.step(self.progress.label)  # its own lines, unsaid
                self.progress.tick = lambda: None  # (the parent says where they are)
                code = 0
                try:
                    record = self._trace(w, micro, sync, layers)
                    data = json.dumps({"key": self._key(w, micro, sync, layers), "trace": record})
                    with os.fdopen(write, "w") as out:
                        out.write(data)
                except BaseException:  # noqa: BLE001 (the parent traces it itself, and says why)
                    code = 1
                os._exit(code)
            os.close(write)
            children.append((pid, read))
        texts = {read: [] for _, read in children}
        open_ = set(texts)
        while open_:  # each child's record as it comes, the progress line said meanwhile
            ready, _, _ = select.select(list(open_), [], [], 0.5)
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    texts[fd].append(chunk)
                else:
                    open_.discard(fd)
                    os.close(fd)
            self.progress.tick()
        for pid, read in children:
            os.waitpid(pid, 0)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                answer = json.loads(b"".join(texts[read]))
                self.traces[answer["key"]] = answer["trace"]

    def _parsed(self, trace: dict[str, Any]):
        """``trace`` (one of ``traces``) as an ``Estimate``, read once (an 8B model's
        sequence is tens of thousands of events); ValueError where it is damaged."""
        from gradaccum.planning.estimate.result import Estimate

        if id(trace) not in self._estimates:
            self._estimates[id(trace)] = (trace, Estimate.from_dict(trace))
        return self._estimates[id(trace)][1]

    def _key(self, w: _Workload, micro: int, sync: str, layers: int | None) -> str:
        return f"{w.key}|{sync}|micro {micro} x {self._windows(micro)}|{layers or 'all'} blocks"

    def _pair(self, w: _Workload, sync: str, windows: int) -> tuple[dict, dict] | None:
        """Two whole-model traces of ``w``'s window of ``windows`` micro-batches at sizes of
        2 or more, each with its allocation sequence, that show the other sizes: what they
        are read off."""

        kept = [
            t
            for k, t in self.traces.items()
            if k.startswith(f"{w.key}|{sync}|micro ")
            and k.endswith(f" x {windows}|all blocks")
            and t.get("stream")
            and t["micro_batch"] >= 2
        ]
        kept.sort(key=lambda t: t["micro_batch"])
        if len(kept) < 2:
            return None
        a, b = (self._parsed(t).stream for t in kept[:2])
        return (kept[0], kept[1]) if a.grows(b) is not None else None

    def _trace(self, w: _Workload, micro: int, sync: str, layers: int | None) -> dict[str, Any]:
        import gradaccum as ga

        windows = self._windows(micro)
        key = self._key(w, micro, sync, layers)
        if key in self.traces:
            return self.traces[key]
        if not self.tracing:
            raise _Untraced(key)
        w = w.ready()
        what = f"{layers} of {w.layers} blocks" if layers else "the whole model"
        self.progress.step(
            f"tracing micro-batch {micro} x {windows}"
            + (f" of {w.length} tokens" if self.cfg.longest and w.length else "")
            + f", {what}"
            + (", checkpointed" if w.checkpointing else "")
        )
        prepare = w.prepare
        # the second window as its first repeated, where a trace of both windows of this
        # training showed it to be (half the time; the same bytes)
        repeat = any(
            t.get("steady") for k, t in self.traces.items() if k.startswith(f"{w.key}|{sync}|")
        )

        def watched(model):
            return self.progress.watch(prepare(model) if prepare is not None else model)

        zero, optimizer = self.deepspeed(w)
        est = ga.estimate(
            w.build(layers),
            optimizer,
            w.sample,
            w.loss_fn,
            micro_size=micro,
            micro_batches=windows,
            gpu=self.cfg.gpu,
            precision=self.cfg.precision,
            checkpointing=w.checkpointing,
            prepare=watched,
            world_size=self.cfg.world_size,
            shard="zero" if zero is not None else self.cfg.shard,
            sync=sync,
            repeat=repeat,
            keep=layers in (None, 2),
            deepspeed=zero,
        )
        self.traces[key] = {**est.to_dict(), "steady": est.steady and not repeat}
        return self.traces[key]

    def deepspeed(self, w: _Workload):
        """--deepspeed's configuration as the estimate models it (None without it), and the
        optimizer: DeepSpeed's FusedAdam (modelled as torch's fused AdamW: in place, its
        moments made at the first step) where the file names one, else --optimizer's, which
        Hugging Face's Trainer builds and hands to DeepSpeed."""
        if self.cfg.deepspeed is None:
            return None, _optimizer(self.cfg.optimizer)
        import torch

        from gradaccum.planning.estimate.zero import from_deepspeed

        config = json.loads(Path(self.cfg.deepspeed).read_text(encoding="utf-8-sig"))
        zero = from_deepspeed(config, hidden_size=w.hidden_size, precision=self.cfg.precision)
        kind = str((config.get("optimizer") or {}).get("type", "")).lower()
        if kind in ("adam", "adamw"):
            fused = lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)  # noqa: E731
            return zero, fused
        if kind:
            raise ValueError(
                f"DeepSpeed's optimizer {config['optimizer']['type']!r} is not modelled "
                "(Adam and AdamW are, or none: --optimizer's, built by the Trainer)"
            )
        return zero, _optimizer(self.cfg.optimizer)

    # -- the search ------------------------------------------------------------------------

    def predictor(self, w: _Workload, sync: str, sizes: tuple[int, ...] | None = None):
        """The device total as a line through the micro-batch size: from 2- and 3-block
        traces where the model's blocks are identical (allocated bytes along the layer
        count, the allocator's reserve over them as the 3-block model's), else from the
        whole model at 1 and 2."""
        sizes = sizes or ((1, 2) if self.per_rank >= 2 else (1,))

        def at(micro: int) -> float:
            if w.layers is None:
                return self.full(w, micro, sync)["total"]
            two, three = (self._trace(w, micro, sync, n) for n in (2, 3))
            more = w.layers - 2

            def along(name: str) -> float:
                return two[name] + more * (three[name] - two[name])

            outside = along("total") - along("reserved")  # the context, paged state
            return along("allocated") + (three["reserved"] - three["allocated"]) + outside

        points = [at(m) for m in sizes]
        slope = points[1] - points[0] if len(points) > 1 else 0.0
        return lambda m: points[0] + (m - 1) * max(slope, 0.0)

    def largest(self, w: _Workload, sync: str) -> tuple[int, dict[str, Any]] | None:
        """The largest micro-batch whose whole-model trace fits the budget, and its trace;
        None where a micro-batch of 1 does not. Each whole-model trace corrects the line's
        guess by its own error, within the sizes not yet decided; the answer is decided by
        traces alone: it fits, and the next size (unless it is the whole batch) does not."""
        whole = lambda m: self.full(w, m, sync)["total"]  # noqa: E731
        predict = self._reader(w, sync) or self.predictor(w, sync)
        fits = self._decide(predict, whole, self.per_rank)
        return (fits, self.full(w, fits, sync)) if fits else None

    def _reader(self, w: _Workload, sync: str):
        """The device total guessed at each size on the line through the whole model's
        traces at 2 and 3 (made here where they are not yet; the sizes that decide are then
        read off them); None where the batch is too small for them, or where the two do not
        show the other sizes."""
        if self.per_rank <= 3:
            return None
        if w.layers is not None:
            # the 2-block model's both windows at 2: whether the whole model's second window
            # may be its first repeated; beside it, at 3 what another length's question reads
            # this one with (and 1, in a first question), or what this one is read with
            earlier = self._earlier(w, sync)
            mine = [(w, m, 2) for m in ((2, 3) if earlier else (1, 2, 3))]
            self._side_by_side(mine + [(earlier, m, 2) for m in (2, 3) if earlier], sync)
            self._trace(w, 2, sync, 2)
            if earlier:  # read off an earlier length's traces, at 2 and 3 (the sizes from 2
                # up are read off them; 1, where the search needs it, is read as it does)
                for micro in (2, 3):
                    if self._key(w, micro, sync, None) not in self.traces:
                        self._lengthened(w, micro, sync)
                if all(self._key(w, m, sync, None) in self.traces for m in (2, 3)):
                    return self._read_at(w, sync)
        self._at_once(w, sync, (1, 2, 3))  # 1 is laid out otherwise: traced, never read
        return self._read_at(w, sync)

    def _read_at(self, w: _Workload, sync: str):
        """``_reader``'s answer once the whole model at 2 and 3 is traced or read."""
        for micro in (2, 3):
            self.full(w, micro, sync)
        pair = self._pair(w, sync, 2)
        if pair is None:
            return None
        two, three = (t["total"] for t in pair)
        # the line through them guesses (each size read is a replay of the whole model's
        # sequence, a third of a second for an 8B model); the sizes that decide are read
        return lambda micro: two + (micro - 2) * max(three - two, 0)

    def _decide(self, predict, whole, top: int) -> int:
        """The largest n in 1..``top`` whose ``whole(n)`` (a whole-model trace's total, each
        kept) fits the budget, 0 where none does: ``predict(n)`` guesses, each whole trace
        moves the guess by its own error within the sizes not yet decided, and the answer is
        decided by whole traces alone (n fits, n + 1 does not unless n is ``top``)."""
        fits, fails = 0, top + 1
        guess = self._largest_under(predict, 0.0, 1, top) or 1
        while True:
            total = whole(guess)
            if total <= self.budget:
                fits = guess
            else:
                fails = guess
            if fails - fits <= 1:
                return fits
            after = self._largest_under(predict, total - predict(guess), fits + 1, fails - 1)
            # nothing above what fits is guessed to: the next size is traced to know it
            guess = after if after is not None else fits + 1

    def _largest_under(self, predict, error: float, low: int, high: int) -> int | None:
        if low > high or predict(low) + error > self.budget:
            return None
        while low < high:
            mid = (low + high + 1) // 2
            if predict(mid) + error <= self.budget:
                low = mid
            else:
                high = mid - 1
        return low

    def alternatives(self, asked: _Workload) -> list[dict[str, Any]]:
        """Each change not already made to ``asked``, alone, at micro-batch 1: its device
        total: the whole model's trace where one is kept (an earlier question's), else the
        line through its 2- and 3-block traces."""
        cfg, checkpointing, sync = self.cfg, asked.checkpointing, self.syncs[-1]
        changes: list[tuple[str, dict[str, Any], bool]] = []
        if not checkpointing:
            changes.append(("--checkpointing on", {}, True))
        if cfg.precision == "fp32":
            changes.append(("--precision bf16", {"precision": "bf16"}, checkpointing))
        if cfg.hf_model is not None and cfg.lora is None and asked.task == "causal-lm":
            changes.append(("--lora 16", {"lora": "16"}, checkpointing))
        if cfg.lora is not None and cfg.quantize is None:
            changes.append(("--quantize nf4", {"quantize": "nf4"}, checkpointing))
        if asked.length is not None and asked.length >= 64:
            half = asked.length // 2
            changes.append((f"--seq-len {half}", {"seq_len": half}, checkpointing))
        from gradaccum.planning.estimate.trace import TraceError

        out = []
        for flag, change, ck in changes:
            try:
                w = _Workload(dataclasses.replace(cfg, **change), ck, self.traces, self.tracing)
                # a whole-model trace kept (the shorter length an earlier question asked)
                traced = w.layers is None or self._key(w, 1, sync, None) in self.traces
                if traced:
                    total = self.full(w, 1, sync)["total"]
                else:
                    total = self.predictor(w, sync, sizes=(1,))(1)
            except (TraceError, ValueError, TypeError):
                continue  # a change this model cannot take (no repeated blocks to checkpoint)
            out.append({"flag": flag, "total": int(total), "traced": traced})
        return out


def _optimizer(name: str):
    """The optimizer for ``--optimizer NAME``: torch's and transformers' Adafactor as they run
    (traced), bitsandbytes' 8-bit ones by their documented state layout (Blockwise8bit)."""
    import torch

    from gradaccum.planning.estimate.optimizers import Blockwise8bit

    def adafactor(p):
        from gradaccum.integrations import hf_models

        # the Trainer's --optim adafactor: no first moment (beta1=None), a fixed learning rate
        return hf_models.adafactor(p, lr=1e-4, scale_parameter=False, relative_step=False)

    makers = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        "adafactor": adafactor,
        "adamw8bit": lambda p: Blockwise8bit(p, states=2),
        "paged_adamw8bit": lambda p: Blockwise8bit(p, states=2, paged=True),
        "lion8bit": lambda p: Blockwise8bit(p, states=1),
    }
    return makers[name]


# what the estimate assumed of each optimizer that is not torch's own
_OPTIMIZER_ASSUMED = {
    "adafactor": "transformers' Adafactor (beta1=None: factored second moments, no first), "
    "traced as it runs",
    "adamw8bit": "bitsandbytes' AdamW8bit by its documented state layout (uint8 state1/state2, "
    "float32 absmax per 256 values, 256-entry maps; float32 states under 4,096 values), "
    "not traced: its step is one in-place kernel",
    "paged_adamw8bit": "bitsandbytes' PagedAdamW8bit by its documented state layout (as "
    "AdamW8bit; states of parameters of 100,000 values or more paged)",
    "lion8bit": "bitsandbytes' Lion8bit by its documented state layout (uint8 state1, float32 "
    "absmax per 256 values, a 256-entry map), not traced: its step is one in-place kernel",
}


# a configuration's architecture names its head: the class name's ending
_HEADS = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForMaskedLM": "masked-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForImageClassification": "image-classification",
}


def task_of(config: Any, given: str | None) -> str:
    """``--task``, else the head the configuration's ``architectures`` names, else a causal
    LM."""
    if given:
        return given
    for name in getattr(config, "architectures", None) or ():
        for ending, task in _HEADS.items():
            if name.endswith(ending):
                return task
    return "causal-lm"


# the place of the sequence length among a workload key's fields (``_Workload.key``)
_LENGTH_FIELD = 3
# what a workload's record keeps, so that a search that traces nothing need not build it
_DESCRIBED = ("layers", "task", "positions", "length", "assumed")


class _Workload:
    """What one estimate traces: the model factory (``build(layers)``: the whole model, or
    one of ``layers`` identical blocks where ``self.layers`` says it has that many), the
    sample, the loss and LoRA step, and what it assumed; ``key`` names it among the traces."""

    def __init__(
        self,
        cfg: PlanConfig,
        checkpointing: bool,
        traced: dict[str, Any] | None = None,
        build: bool = True,
    ) -> None:
        self.checkpointing = checkpointing
        self.key = "|".join(
            str(x)
            for x in (cfg.precision, cfg.lora, cfg.quantize, cfg.seq_len, checkpointing)
            + (cfg.attn_implementation, cfg.deepspeed)
        )
        # traces of its 2-block model already made: its blocks were found identical then
        self.known = any(
            k.startswith(f"{self.key}|") and k.endswith("|2 blocks") for k in traced or ()
        )
        self.layers: int | None = None
        self.task: str | None = None  # --hf-model's head (None: a recipe)
        self.positions: int | None = None
        self.length: int | None = None  # tokens per sequence, a text model's
        self.hidden_size: int | None = None  # --hf-model's (DeepSpeed's 'auto' buckets)
        self._cfg, self._pending = cfg, False
        if cfg.hf_model is None:
            from gradaccum.app.recipes import get_recipe

            recipe = get_recipe(cfg.recipe)
            self.assumed = [f"recipe {recipe.name}: its own model and sample shape"]
            self.model, self.sample, self.loss_fn = (
                recipe.build_model,
                recipe.sample_batch,
                recipe.loss_fn,
            )
            self.prepare = None
            return
        # what an earlier search found of it (its blocks, head, lengths and assumptions):
        # the model is built only when a trace needs it
        record = (traced or {}).get(f"{self.key}|workload")
        if isinstance(record, dict) and set(record) == set(_DESCRIBED):
            for name in _DESCRIBED:
                setattr(self, name, record[name])
            self._pending = True
            return
        if not build:
            raise _Untraced(f"{self.key}|workload")
        self._hf(cfg)
        if traced is not None:
            traced[f"{self.key}|workload"] = {n: getattr(self, n) for n in _DESCRIBED}

    def ready(self) -> _Workload:
        """The workload with its model factory, sample, loss and LoRA step (built now where
        an earlier search's record stood in for them)."""
        if self._pending:
            self._pending = False
            self._hf(self._cfg, recorded=True)
        return self

    def build(self, layers: int | None = None):
        return self.model if layers is None else self._reduced(layers)

    def _hf(self, cfg: PlanConfig, recorded: bool = False) -> None:
        import torch

        from gradaccum.app.recipes import hf_recipe
        from gradaccum.integrations import hf_models

        recipe = hf_recipe(cfg.hf_model, build_check=False)  # refuses remote code
        config = hf_models.config(cfg.hf_model)  # a folder or its config file
        task = self.task = task_of(config, cfg.task)
        if cfg.lora is not None and task != "causal-lm":
            raise ValueError(
                f"--lora with a {task} head is not modelled (PEFT trains a copy of the head "
                "beside the adapters); estimate it without --lora, or a causal LM"
            )
        images = task == "image-classification"
        if images and cfg.seq_len is not None:
            raise ValueError(
                "--seq-len applies to text models; an image model's size is its config's"
            )
        positions = [getattr(config, n, None) for n in _POSITIONS]
        positions = [p for p in positions if isinstance(p, int) and p >= 1]
        self.positions = min(positions) if positions else None
        text = getattr(config, "text_config", None) or config
        self.hidden_size = getattr(config, "hidden_size", None) or getattr(
            text, "hidden_size", None
        )
        self.length = None if images else (cfg.seq_len or min([128, *positions]))
        length = cfg.seq_len or min([128, *positions])
        low = cfg.precision == "bf16-true" or (cfg.lora is not None and cfg.precision == "bf16")
        if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0  # a decoder's head finds each sequence's last token by it
        if images:
            side = config.image_size
            shape = (
                config.num_channels,
                *(side if isinstance(side, (list, tuple)) else (side, side)),
            )
            what = f"{shape[1]}x{shape[2]} images"
        else:
            what = f"{length} tokens per sequence"
        self.assumed = [
            f"{config.model_type} {task.replace('-', ' ')} from its config (random init: "
            f"weights never load), {what}",
        ]

        # flash_attention_2 needs its package, which no CPU has: built with SDPA, whose
        # call the trace runs as CUDA's flash kernel (the same output and log-sum-exp kept)
        flash = cfg.attn_implementation == "flash_attention_2"
        attention = "sdpa" if flash else cfg.attn_implementation

        def build(model_config: Any = config):
            def make() -> torch.nn.Module:
                if not low:
                    return hf_models.for_task(model_config, task, attention)
                # built in bf16 (a conversion after the build would be one more copy)
                previous = torch.get_default_dtype()
                torch.set_default_dtype(torch.bfloat16)
                try:
                    return hf_models.for_task(model_config, task, attention)
                finally:
                    torch.set_default_dtype(previous)

            return make

        def sample(n: int) -> dict[str, torch.Tensor]:
            if images:
                return {"pixel_values": torch.zeros(n, *shape), "labels": torch.zeros(n).long()}
            ids = torch.zeros(n, length, dtype=torch.long)
            one = task == "sequence-classification"
            return {"input_ids": ids, "labels": torch.zeros(n).long() if one else ids}

        self.model, self.sample = build(), sample
        self.flash = flash
        chosen = _attention_of(config, task, attention)
        if flash:
            self.assumed.append(
                "attention: flash_attention_2 (--attn-implementation), modelled as CUDA's "
                "flash kernel under SDPA: the output and its log-sum-exp kept, never the matrix"
            )
        elif cfg.attn_implementation:
            self.assumed.append(f"attention: {chosen} (--attn-implementation)")
        else:
            self.assumed.append(
                f"attention: {chosen}, what transformers picks for this model (--attn-"
                "implementation eager if the run keeps the attention matrix)"
            )
        self.loss_fn = recipe.loss_fn if task == "causal-lm" else head_loss
        self.prepare = self._lora(cfg, low)
        self._reduced = lambda layers: build(_with_layers(config, layers))
        if not recorded:  # (a record's count was found so before)
            self.layers = (
                config.num_hidden_layers if self.known else _identical_blocks(config, self.model)
            )

    def _lora(self, cfg: PlanConfig, low: bool):
        if cfg.lora is None:
            return None
        from gradaccum.integrations import peft

        if cfg.lora.isdigit():
            rank = int(cfg.lora)
            adapt = lambda m: peft.apply_lora(m, r=rank)  # noqa: E731
            what = f"LoRA r={rank} on the default attention projections"
        else:
            lora = peft.adapter_config(cfg.lora)
            adapt = lambda m: peft.apply_adapter_config(m, cfg.lora)  # noqa: E731
            targets = lora.target_modules
            targets = targets if isinstance(targets, str) else ",".join(sorted(targets or ()))
            saved = ",".join(lora.modules_to_save or ()) or "none"
            what = (
                f"LoRA from {cfg.lora}: r={lora.r}, alpha={lora.lora_alpha}, dropout "
                f"{lora.lora_dropout}, on {targets}; modules trained whole: {saved}"
            )
        base = "bf16" if low else "fp32"
        self.assumed.append(f"{what}, base frozen in {base}")
        # the GPTQ group size, read once for the assumption and every trace's layers
        group = _gptq_group(cfg) if cfg.quantize == "gptq" else None
        if group is not None:
            self.assumed.append(
                f"base's linear layers but the output embedding as auto-gptq's 4-bit QuantLinear "
                f"(group size {group}; packed int32 weights and zeros, float16 scales), "
                "dequantized in torch to a float16 weight that is kept for the backward; "
                f"the other parameters stay in {base}"
            )
        elif cfg.quantize is not None:
            kind = "Linear8bitLt" if cfg.quantize == "8bit" else f"Linear4bit {cfg.quantize}"
            self.assumed.append(
                f"base's linear layers but the output embedding as bitsandbytes' {kind}"
                + (" with double quantization" if cfg.double_quant else "")
                + ", modelled by their documented layout ("
                + (
                    "int8 products; no outlier columns over the 6.0 threshold"
                    if cfg.quantize == "8bit"
                    else f"computing in {base}"
                )
                + f"; the other parameters stay in {base}: prepare_model_for_kbit_training's "
                "fp32 cast not applied)"
            )

        def prepare(model: Any) -> Any:
            model = adapt(model)
            if cfg.quantize is not None:
                from gradaccum.planning.estimate.quantized import quantize

                sized = {} if group is None else {"group_size": group}
                model = quantize(model, cfg.quantize, double_quant=cfg.double_quant, **sized)
            return model

        return prepare


def _attention_of(config: Any, task: str, asked: str | None) -> str:
    """The attention implementation transformers gives this model (``asked``, or its own
    choice), read off the model built on the meta device."""
    import torch

    from gradaccum.integrations import hf_models

    if asked is not None:
        return asked
    layers = getattr(config, "num_hidden_layers", None)
    small = _with_layers(config, 2) if isinstance(layers, int) and layers > 2 else config
    try:
        with torch.device("meta"):
            model = hf_models.for_task(copy.deepcopy(small), task)
    except Exception:  # noqa: BLE001 (said as unknown rather than failing the estimate)
        return "transformers' default"
    return str(getattr(model.config, "_attn_implementation", None) or "transformers' default")


def _with_layers(config: Any, layers: int) -> Any:
    """``config`` with ``layers`` repeated blocks (its per-layer type list cut to match)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = layers
    if isinstance(getattr(out, "layer_types", None), list):
        out.layer_types = out.layer_types[:layers]
    return out


def _identical_blocks(config: Any, build) -> int | None:
    """How many identical repeated blocks the model has, when it is made of them (each
    block's parameters of the same names, shapes and dtypes, one per configured layer) and
    has more than 3; else None (the whole model is traced at every size). Built on the meta
    device: no memory, no weights."""
    import torch

    from gradaccum.recompute import repeated_blocks

    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= 3:
        return None
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and len(set(map(str, kinds))) > 1:
        return None
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 (a model that cannot be built on meta is traced whole)
        return None
    blocks = repeated_blocks(model)
    shapes = {
        tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
        for _, block in blocks
    }
    return layers if len(blocks) == layers and len(shapes) == 1 else None


def head_loss(model: Any, batch: dict[str, Any]) -> tuple[Any, int]:
    """Cross-entropy summed over what is labelled (a token, a sequence or an image), and how
    many: a masked LM's, token or sequence classifier's or image classifier's loss."""
    import torch.nn.functional as F

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits, labels = model(**inputs).logits, batch["labels"]
    flat = logits.reshape(labels.numel(), -1)
    return F.cross_entropy(flat, labels.reshape(-1), reduction="sum"), labels.numel()


if __name__ == "__main__":
    sys.exit(main())
