"""gradaccum.app.trainer: a run trained in-process by ``Trainer(build_run(cfg)).fit()``, a
resume that is the same run bit for bit, and a loop that stays small and delegates."""

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
from support.runs import digits_config, quiet

from gradaccum.app import Trainer, build_run
from gradaccum.app.folder import CHECKPOINT, METRICS

APP = Path(__file__).resolve().parents[2] / "src" / "gradaccum" / "app"


def losses(folder: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / METRICS).read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / CHECKPOINT, weights_only=True)["accumulator"]["model"]


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_a_stopped_and_resumed_run_is_the_straight_run_bit_for_bit(tmp_path):
    straight = tmp_path / "straight"
    summary = Trainer(build_run(digits_config(straight), log=quiet), quiet).fit()
    assert summary["steps"] == 6 and summary["stopped_by"] == "length"
    resumed = tmp_path / "resumed"
    # the loop alone for the two sessions (fit() adds the report: plots and a page)
    for options in ({"steps": 3}, {"steps": 6, "resume": str(resumed)}):
        run = build_run(digits_config(resumed, **options), log=quiet)
        try:
            Trainer(run, quiet).loop()
        finally:
            run.folder.release()
    assert losses(resumed) == losses(straight)
    a, b = weights(resumed), weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def function_lines(name: str) -> int:
    source = inspect.getsource(getattr(Trainer, name))
    return len([x for x in source.splitlines() if x.strip()])


def test_the_loop_is_at_most_sixty_lines():
    for name in ("fit", "loop", "window"):
        assert function_lines(name) <= 60, name


LOOP = ("fit", "loop", "window", "advance", "line")
RANK_WORDS = {"rank", "main", "is_main", "world", "replicas", "together", "writes"}
KIND_WORDS = {"Replicated", "Sharded", "Pipelined", "PipelineWindow", "sharded", "stages"}


def test_the_loop_names_no_rank_no_kind_of_run_and_no_file():
    import textwrap

    for name in LOOP:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(Trainer, name))))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not names & (RANK_WORDS | KIND_WORDS), (name, names & (RANK_WORDS | KIND_WORDS))
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        files = [x for x in strings if isinstance(x, str) and "." in x and " " not in x]
        assert files == [], (name, files)


def test_the_check_sees_a_rank_and_a_file_name():
    tree = ast.parse("if run.main:\n    folder.write_json('summary.json', x)\n")
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert names & RANK_WORDS == {"main"}
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)] == ["summary.json"]


def test_no_shipped_function_takes_a_fault_injection_argument():
    import gradaccum

    src = Path(gradaccum.__file__).parent
    for file in src.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in [*node.args.args, *node.args.kwonlyargs]]
                assert not {"faults", "fault", "inject"} & set(args), (file, node.name)


def test_a_window_of_one_micro_batch_is_said_to_be_no_accumulation(tmp_path):
    """docs/cli.md's run.toml (digits, 256 in 300MB) plans the whole batch as one micro-batch:
    the run's first line said '1 micro-batch of up to 256', leaving 'no accumulation' to
    arithmetic."""
    for micro, shape in (
        (16, "effective batch 16 = 1 micro-batch of 16 (no accumulation);"),
        (6, "effective batch 16 = 3 micro-batches of up to 6;"),
    ):
        said: list[str] = []
        run = build_run(digits_config(tmp_path / str(micro), micro_batch=micro), log=quiet)
        try:
            Trainer(run, said.append).announce()
        finally:
            run.folder.release()
        assert shape in said[0], said


def test_a_component_is_added_without_touching_the_loop(tmp_path):
    """A component of the test's own (``boundary.Component``: ``phase``, ``due``, ``run``)
    given to the Trainer runs at the boundaries it is due at, after the checkpoint of the
    same step, with the record every component gets; its memory phase is counted apart."""
    from gradaccum.app.boundary import Boundary

    class EveryOther:
        phase = "upload"

        def __init__(self) -> None:
            self.seen: list[Boundary] = []

        def due(self, at: Boundary) -> bool:
            return at.step % 2 == 0 or at.end

        def run(self, at: Boundary) -> None:  # the step's checkpoint is written by now
            kept = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)["step"]
            self.seen.append(dataclasses.replace(at, step=(at.step, kept)))

    extra = EveryOther()
    config = digits_config(tmp_path / "run", steps=3, checkpoint_every=2, eval_every=100)
    run = build_run(config, log=quiet)
    try:
        Trainer(run, quiet, components=[extra]).loop()
    finally:
        run.folder.release()
    phases = json.loads((tmp_path / "run" / "memory.json").read_text())["phases"]
    assert {"training", "checkpoint", "upload"} <= set(phases), phases
    assert [(b.step, b.end, b.hit, b.stopping) for b in extra.seen] == [
        ((2, 2), False, None, False),
        ((3, 3), True, None, False),
    ]


def test_a_sink_is_added_in_a_few_lines(tmp_path):
    """A CSV file of each step's loss: a sink of the test's own (``report.sink.Sink``: open,
    write, restart, close) given to the Trainer gets every line metrics.jsonl gets, and is
    closed at the end."""

    class Csv:
        def __init__(self, path: Path) -> None:
            self.path, self.file = path, None

        def open(self, start: int) -> None:
            self.file = self.path.open("w")
            self.file.write("step,loss\n")

        def write(self, line: dict, at) -> None:
            self.file.write(f"{line['step']},{line['loss']}\n")

        def restart(self, step: int) -> None:
            pass

        def close(self) -> None:
            self.file.close()

    csv = Csv(tmp_path / "loss.csv")
    run = build_run(digits_config(tmp_path / "run", steps=3, eval_every=100), log=quiet)
    try:
        Trainer(run, quiet, sinks=[csv]).loop()
    finally:
        run.folder.release()
    want = [f"{x['step']},{x['loss']}" for x in run.folder.metrics()]
    assert len(want) == 3 and csv.path.read_text().splitlines() == ["step,loss", *want]
    assert csv.file.closed
