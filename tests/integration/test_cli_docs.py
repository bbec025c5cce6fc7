"""docs/cli.md's command examples stay true: every one is accepted by the command as written
(parsed, and its configuration checked the way the command checks it), and a subset that
runs in seconds on digits runs as written, with the outcome the docs describe.

The examples' placeholders are made real by the test: `./my-gpt2` is a tiny GPT-2 the test
builds, a `runs/gpt-...` folder is a run the test trains, `run.toml` is the file the docs
show under "Config files"."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from test_faults import ROOT, in_process

from gradaccum.app.cli import options, parser
from gradaccum.app.cli.train import resolve
from gradaccum.app.config import CheckConfig, PlanConfig

DOC = ROOT / "docs" / "cli.md"
RUN_PLACEHOLDER = re.compile(r"runs/gpt-\d{8}-\d{6}")


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def examples() -> list[str]:
    """Every command line in docs/cli.md's bash blocks, its trailing comment cut."""
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith(("gradaccum ", "torchrun ")):
                found.append(line)
    return found


def argv(example: str, places: dict[str, str]) -> list[str]:
    """The example's arguments after `gradaccum`, placeholders replaced, a redirect cut."""
    example = example.split(" > ", 1)[0]
    example = RUN_PLACEHOLDER.sub(places["run"], example)
    words = shlex.split(example)
    words = words[words.index("gradaccum") + 1 :] if "gradaccum" in words else words[1:]
    return [places.get(w, w) for w in words]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    import transformers

    tmp = tmp_path_factory.mktemp("docs")
    gpt2 = tmp / "my-gpt2"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=64)
    config.save_pretrained(gpt2)  # a config only: the random init the docs describe
    (toml,) = [b for b in blocks("toml") if b.startswith("# run.toml")]
    (tmp / "run.toml").write_text(toml)
    run = tmp / "run"
    short = ["--epochs", "1", "--micro-batch", "64", "--no-tensorboard"]  # no planning
    done = in_process("train", "--recipe", "digits", *short, "--out", run)
    assert done.returncode == 0, done.stderr
    return {"./my-gpt2": str(gpt2), "run.toml": str(tmp / "run.toml"), "run": str(run)}


def test_the_docs_show_an_example_of_every_command():
    commands = {shlex.split(e)[shlex.split(e).index("gradaccum") + 1] for e in examples()}
    assert commands == {"train", "plan", "check", "audit", "report"}, commands
    assert len(examples()) >= 15


@pytest.mark.parametrize("example", examples())
def test_every_example_in_docs_cli_md_is_accepted_as_written(example, places):
    words = argv(example, places)
    args, command = parser().parse_args(words), words[0]
    if command == "train":
        resolve(args)  # raises ValueError with every problem, as the command does
    elif command in ("plan", "check"):
        kind = PlanConfig if command == "plan" else CheckConfig
        assert kind(**options.given(args, kind)).problems() == []
    elif command == "audit":
        file, _, function = args.target.rpartition(":")
        assert file.endswith(".py") and function.isidentifier(), args.target
    else:
        assert command == "report"


@pytest.mark.slow
def test_the_quick_examples_run_as_written(places, tmp_path, monkeypatch):
    """digits' examples, as the docs show them (only --out added, into a temporary folder)."""
    monkeypatch.chdir(tmp_path)
    quick = [e for e in examples() if "digits" in e or "report" in e or "--resume" in e]
    ran = {}
    run = tmp_path / "digits-run"
    for example in quick:
        words = argv(example, {**places, "run": str(run)})
        if words[0] == "train" and "--resume" not in words:
            if "torchrun" in example:
                continue  # tests/integration/distributed runs torchrun
            words += ["--out", str(run), "--no-tensorboard"]
        ran[example] = in_process(*words)
        assert ran[example].returncode == 0, (example, ran[example].stderr)
    assert "gradaccum train --recipe digits --epochs 5" in ran
    assert "gradaccum check --recipe digits --batch 32 --micro-batch 8" in ran
    plan = next(v for k, v in ran.items() if "--json" in k)
    table = json.loads(plan.stdout)  # the redirect's file: JSON alone on stdout
    assert table["recipe"] == "digits" and sum(table["micro_sizes"]) == table["effective_batch"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 300  # begun with --epochs, continued by --steps
    assert (tmp_path / "run.html").is_file() and (run / "report.html").is_file()
