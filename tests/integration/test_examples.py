"""The README stays true: its quickstart runs in a fresh process, and it shows the Accumulator's
signature as the code has it."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradaccum as ga

ROOT = Path(__file__).resolve().parents[2]


def run(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_equivalence_example_shows_exact_accumulation_and_the_naive_error():
    out = run("equivalence.py")
    naive = float(re.search(r"naive: mean per micro-batch / N \|\s+(\S+)", out).group(1))
    ours = float(re.search(r"gradaccum: \(sum, count\)\s+\|\s+(\S+)", out).group(1))
    assert ours <= 1e-6 and naive > 0.1, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0] - 1.0, out  # training visibly works


def test_readme_quickstart_is_the_example_file_and_runs():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "quickstart.py").read_text()
    assert example.strip() in readme, "README's quickstart drifted from examples/quickstart.py"
    out = run("quickstart.py")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 10 and losses[-1] < losses[0]


def signature_text(fn) -> str:
    """``fn``'s parameters after ``self`` as the README writes them: positional ones by name,
    then ``*``, then keyword-only ones as name=default, strings in double quotes."""
    parts, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            default = p.default
            shown = f'"{default}"' if isinstance(default, str) else repr(default)
            parts.append(f"{p.name}={shown}")
    return ", ".join(parts)


def squeeze(text: str) -> str:
    """Whitespace-insensitive: runs of whitespace become one space, none after "("."""
    return re.sub(r"\s+", " ", text).replace("( ", "(")


def test_readme_shows_the_accumulators_signature():
    params = signature_text(ga.Accumulator.__init__)
    assert params.startswith("model, optimizer, *, "), params
    expected = f"acc = ga.Accumulator({params})"
    for page in ("README.md", "docs/api.md"):
        text = squeeze((ROOT / page).read_text())
        assert expected in text, f"{page} does not show the Accumulator's signature: {expected}"


def test_transformers_trainer_example_is_exact_where_the_plain_trainer_is_not():
    out = run("transformers_trainer.py")
    plain = float(re.search(r"transformers\.Trainer\s+(\S+)", out).group(1))
    ours = float(re.search(r"gradaccum's Trainer\s+(\S+)", out).group(1))
    assert ours <= 1e-6 < 1e-3 < plain, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) nats/token", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, out
    assert "B_simple" in out


@pytest.mark.slow
def test_lightning_trainer_example_is_exact_where_the_plain_recipe_is_not():
    out = run("lightning_trainer.py")
    plain = float(re.search(r"mean per micro-batch\s+(\S+)", out).group(1))
    ours = float(re.search(r"ExactAccumulation\s+(\S+)", out).group(1))
    assert ours <= 1e-6 < 1e-3 < plain, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) nats/token", out)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, out
