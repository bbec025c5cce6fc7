"""A plan-cache hit as a person meets it (issue 46): `gradaccum plan` answered from a stored
plan (the whole command's wall time), and `gradaccum train` from its start to the line that
says its plan is the cached one, beside a bare `python -c "import torch"`, alternating for
ROUNDS rounds, each command's plan stored first in a private cache. Prints medians and ranges;
bench/results/planner.md keeps the numbers by hand (its "plan cache hit" section).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = 5
SETTINGS = ["--recipe", "digits", "--effective-batch", "256", "--budget", "150MB"]


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="cache-hit-")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "GRADACCUM_PLAN_CACHE": f"{tmp}/plans",
        "PYTHONUNBUFFERED": "1",
    }
    ga = [sys.executable, "-m", "gradaccum"]
    plan = [*ga, "plan", *SETTINGS]
    train = [*ga, "train", *SETTINGS, "--steps", "1", "--no-tensorboard"]
    subprocess.run(plan, env=env, capture_output=True, check=True)  # the plans stored
    subprocess.run([*train, "--out", f"{tmp}/run-0"], env=env, capture_output=True, check=True)

    def whole(cmd: list[str]) -> float:
        began = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - began
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-400:]}")
        return took

    def until_cached(cmd: list[str]) -> float:
        began = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        said = None
        for line in proc.stdout:
            if said is None and line.startswith("the plan is the cached one"):
                said = time.perf_counter() - began
        if proc.wait() != 0 or said is None:
            raise SystemExit(f"{' '.join(cmd)}: no cached plan said")
        return said

    times: dict[str, list[float]] = {"plan": [], "train": [], "import torch": []}
    for r in range(ROUNDS):
        times["import torch"].append(whole([sys.executable, "-c", "import torch"]))
        times["plan"].append(whole(plan))
        times["train"].append(until_cached([*train, "--out", f"{tmp}/run-{r + 1}"]))
    for name, seconds in times.items():
        print(
            f"{name}: median {statistics.median(seconds):.2f} s, "
            f"{min(seconds):.2f}-{max(seconds):.2f} s over {len(seconds)}"
        )
    print("load average at the end:", ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
