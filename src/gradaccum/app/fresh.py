"""Work in a fresh process, one protocol: ``python -m gradaccum.app.worker``.

A plan measures where training will run: in a new process, from its first step. Two kinds
of work go there, each a typed request (a dataclass, one JSON line on the child's stdin):

- ``Measure``: build a recipe's model (or ``--hf-model``'s, with its LoRA), then wait, built,
  for a ``Size`` on a second line, and measure a window of it (``planning``'s verifier);
- ``PlanRun``: make a run's plan as ``gradaccum train`` makes it, from the run's
  configuration (``gradaccum train`` on the CPU).

The child answers on stdout, one JSON object a line: ``{"log": line}`` for what it says,
then ``{"answer": ...}`` or ``{"error": one line}`` (a refusal, as ``ValueError`` in the
parent). Its stdin is a pipe only the parent writes to: once the child has what it was
asked, the end of its input means the parent is gone (or has no use for it), and it exits.

Standard library only: the parent imports this before it needs torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

__all__ = ["Child", "Measure", "PlanRun", "Size", "answer", "read_request", "read_size", "say"]


@dataclass(frozen=True, kw_only=True)
class Measure:
    """Build a model, then measure the ``Size`` sent next: peak bytes of ``windows`` windows
    of it (``meter``: the plan's), trained as the run trains (``precision``, ``seed``)."""

    kind: ClassVar[str] = "measure"
    recipe: str | None = None
    hf_model: str | None = None
    lora: dict[str, Any] | None = None  # apply_lora's arguments, as the run applies them
    precision: str = "fp32"
    seed: int = 0
    meter: str = "auto"
    windows: int = 2  # resident memory settles after the first


@dataclass(frozen=True, kw_only=True)
class Size:
    """The size a waiting ``Measure`` process measures: windows of ``micro_batches``
    micro-batches of ``micro_size`` (``checkpointing``: the plan's recomputation), on the
    batch saved at ``sample`` (the largest shape the run's data makes) or the recipe's."""

    micro_size: int
    micro_batches: int
    checkpointing: bool = False
    sample: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanRun:
    """A run's plan, made as ``gradaccum train`` makes it: ``config`` is the run's
    configuration (config.json's form), ``sequences`` a file of --data's sequences."""

    kind: ClassVar[str] = "plan"
    config: dict[str, Any] = field(default_factory=dict)
    sequences: str | None = None


KINDS = {kind.kind: kind for kind in (Measure, PlanRun)}


def encode(request: Measure | Size | PlanRun) -> str:
    kind = getattr(type(request), "kind", None)
    return json.dumps({**({"kind": kind} if kind else {}), **asdict(request)})


def read_request(line: str) -> Measure | PlanRun:
    """The request on the first line of the child's stdin (ValueError: not one)."""
    try:
        given = json.loads(line)
        kind = KINDS[given.pop("kind")]
        return kind(**given)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a fresh-process request: {line.strip()[:200]!r} ({err})") from None


def read_size(line: str) -> Size:
    return Size(**json.loads(line))


def say(message: str) -> None:
    """A line the child says (the parent relays it to its log)."""
    print(json.dumps({"log": message}), flush=True)


def answer(value: Any = None, *, error: str | None = None) -> None:
    """The child's answer, or its refusal in one line; the last thing it writes."""
    print(json.dumps({"error": error} if error is not None else {"answer": value}), flush=True)


class Child:
    """One fresh process working on ``request``, started at once (it builds while the parent
    goes on). ``send()`` writes it a further line (a ``Size``); ``result(log)`` relays its
    log lines to ``log`` and returns its answer. ``stderr``: "keep" to hold the child's
    stderr (a model's loading bars) for a failure's message, else it is this process's."""

    def __init__(self, request: Measure | PlanRun, *, stderr: str = "inherit") -> None:
        self._errors = tempfile.TemporaryFile(mode="w+") if stderr == "keep" else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradaccum.app.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
        )
        self.send(request)

    def send(self, request: Measure | Size | PlanRun) -> None:
        try:
            self.proc.stdin.write(encode(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died while building: result() says why

    def result(self, log: Callable[[str], None] | None = None, what: str = "the work") -> Any:
        """The child's answer; ValueError with its refusal; RuntimeError (with its stderr's
        end, when kept) if it ended without one."""
        found: dict[str, Any] = {}
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict) or not {"log", "answer", "error"} & set(message):
                if log is not None:  # a library's own print
                    log(line.rstrip("\n"))
            elif "log" in message:
                if log is not None:
                    log(message["log"])
            else:
                found = message
        self.proc.wait()
        if "error" in found:
            raise ValueError(found["error"])
        if "answer" not in found:
            tail = ""
            if self._errors is not None:
                self._errors.seek(0)
                tail = ":\n" + self._errors.read()[-2000:]
            raise RuntimeError(
                f"{what} in a fresh process failed (exit status {self.proc.returncode}){tail}"
            )
        return found["answer"]

    def close(self) -> None:
        """End the child if it is still running (it holds nothing to finish), and its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except BrokenPipeError:
                pass
        self.proc.wait()
        if self._errors is not None:
            self._errors.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
