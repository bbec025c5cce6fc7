"""The main job: train a recipe with an exact large batch, plan its memory, keep a run folder.

``train(cfg)`` plans the micro-batch, trains window by window through the Accumulator, and
writes the run folder (``gradaccum.app.folder`` says what each file is). The parts:

    config.py          TrainConfig: every option's default, help text and check; what a
                       resume may change
    build.py           before the first window: the folder, model, data, optimizer,
                       micro-batch
    loop.py            the windows: metrics lines, checkpoints, targets, the guard's rollbacks
    report/summary.py  the end: summary.json, plots, report.html, the summary table
"""

from __future__ import annotations

import time
from typing import Any

from gradaccum.app import launch
from gradaccum.app.build import _build
from gradaccum.app.config import RESUMABLE, TrainConfig
from gradaccum.app.loop import Interrupted, _loop, _Output, _quiet
from gradaccum.app.report.summary import _report, final_evaluation
from gradaccum.validate import invalid_configuration

__all__ = ["RESUMABLE", "Interrupted", "TrainConfig", "train"]


def train(cfg: TrainConfig, *, log=print) -> dict[str, Any]:
    """Run (or resume) a training run; returns the summary. Raises ``Interrupted`` after
    checkpointing on SIGINT/SIGTERM/SIGHUP or a closed output pipe, ValueError on bad
    configuration or an unusable run folder (one line each)."""
    return _train(cfg, log, None)


def _train(cfg: TrainConfig, log, faults) -> dict[str, Any]:
    """``train``, with the seam the test suite damages data through (tests/support/faults.py):
    ``faults(position, batch) -> batch`` sees each window's samples before they are split.
    Not public API: training never takes it."""
    problems = cfg.problems()
    if problems:
        raise ValueError(invalid_configuration(problems))
    stop: list[int] = []
    # Under torchrun every process runs this function; rank 0 alone plans, writes the run
    # folder and reports. The effective batch is global: each rank trains its shard of it.
    rank, world = launch.init_from_env()
    log = _Output(log, stop) if rank == 0 else _quiet
    run = _build(cfg, rank, world, log)
    try:
        began = time.perf_counter()
        try:
            _loop(run, log, stop, faults)
        except Interrupted:
            # The run folder's summary, plots and report describe this session, not the last
            # one that ended; the table is not printed (the stop message says what to do).
            last_eval = final_evaluation(run)
            if run.main:
                run.stopped_by = "signal"
                _report(run, log, time.perf_counter() - began, last_eval, table=False)
            raise
        last_eval = final_evaluation(run)
        if not run.main:
            return {"rank": rank}
        return _report(run, log, time.perf_counter() - began, last_eval)
    except BaseException:
        run.folder.abandon()  # only a run that trained no step is removed
        raise
    finally:
        run.folder.release()
