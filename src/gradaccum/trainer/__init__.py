"""The main job: train a recipe with an exact large batch, plan its memory, keep a run folder.

``train(cfg)`` plans the micro-batch, trains window by window through the Accumulator, and
writes the run folder (``gradaccum.runfolder`` says what each file is). The parts:

    config.py    TrainConfig: every option's default, help text and check; what a resume
                 may change
    build.py     before the first window: the folder, model, data, optimizer, micro-batch
    loop.py      the windows: metrics lines, checkpoints, targets, the guard's rollbacks
    summary.py   the end: summary.json, plots, report.html, the summary table
"""

from __future__ import annotations

import time
from typing import Any

from gradaccum import launch
from gradaccum.trainer.build import _build
from gradaccum.trainer.config import RESUMABLE, TrainConfig
from gradaccum.trainer.loop import Interrupted, _loop, _Output, _quiet
from gradaccum.trainer.summary import _report, final_evaluation
from gradaccum.validate import invalid_configuration

__all__ = ["RESUMABLE", "Interrupted", "TrainConfig", "train"]


def train(cfg: TrainConfig, *, log=print, faults=None) -> dict[str, Any]:
    """Run (or resume) a training run; returns the summary. Raises ``Interrupted`` after
    checkpointing on SIGINT/SIGTERM/SIGHUP or a closed output pipe, ValueError on bad
    configuration or an unusable run folder (one line each).

    ``faults``: for tests of the incident guard only, ``faults(position, batch) -> batch``
    may damage the samples of chosen windows (see ``gradaccum.testing.corrupt_samples``)."""
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
    finally:
        run.folder.release()
