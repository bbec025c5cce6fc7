"""The `gradaccum` command, an application on the library: ``gradaccum train/plan/check/report``.

The library (``import gradaccum``) never imports this package; this package imports the
library and its extras (tqdm, pyyaml, matplotlib, and the frameworks a recipe needs). From
Python, ``train(TrainConfig.of(...))`` runs what ``gradaccum train`` runs.

    cli/        one module per command: parse, build, call
    trainer.py  train(): build, loop, report
    config.py build.py loop.py folder.py guard.py targets.py launch.py measure.py
    report/     summary, report.html, plots, TensorBoard events
    recipes/    the built-in models and data
"""

# (a Ctrl-C while this loads, under the command: gradaccum/__init__.py's handler says it)
from gradaccum.app.config import RESUMABLE, TrainConfig
from gradaccum.app.loop import Interrupted
from gradaccum.app.trainer import train

__all__ = ["RESUMABLE", "Interrupted", "TrainConfig", "train"]
