"""The `gradaccum` command, an application on the library: ``gradaccum train/plan/check/report``.

The library (``import gradaccum``) never imports this package; this package imports the
library and its extras (tqdm, pyyaml, matplotlib, and the frameworks a recipe needs). From
Python, ``train(TrainConfig.of(...))`` runs what ``gradaccum train`` runs, and is
``Trainer(build_run(cfg)).fit()``.

    cli/          one module per command: parse, resolve, build, call, exit code
    process.py    signals, exit codes, output that survives a closed pipe
    config.py     every option's default, help and check; what a resume may change
    build.py      build_run(cfg): the Run (run.py) a training run starts from
    trainer.py    Trainer(run).fit(): the loop over its components (listed there)
    kinds.py      one process or DDP, FSDP2, a pipeline: what differs between them
    folder.py     the run folder: layout, lock, atomic writes, JSON; every file name
    planner.py planning.py plan_cache.py    the plan of a run
    fresh.py worker.py measure.py   the plan's fresh processes: one request, one entry point
    report/       summary, report.html, plots, TensorBoard events, the metrics sink
    recipes/      the built-in models and data

The names below load on first use: the command's entry point imports this package before
torch loads (gradaccum.app.process).
"""

import importlib as _importlib

_WHERE = {
    "RESUMABLE": "gradaccum.app.config",
    "TrainConfig": "gradaccum.app.config",
    "Interrupted": "gradaccum.app.stops",
    "Run": "gradaccum.app.run",
    "build_run": "gradaccum.app.build",
    "Trainer": "gradaccum.app.trainer",
    "train": "gradaccum.app.trainer",
}

__all__ = ["RESUMABLE", "Interrupted", "Run", "TrainConfig", "Trainer", "build_run", "train"]


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gradaccum.app' has no attribute {name!r}")
    return getattr(_importlib.import_module(module), name)
