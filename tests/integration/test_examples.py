"""The README's commands stay true: the demo and the quickstart run in fresh processes."""

import re
import subprocess
import sys
from pathlib import Path

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
