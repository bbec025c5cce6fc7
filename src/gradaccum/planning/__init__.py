"""Planning: the micro-batch that fits a memory budget, measured where the run will train.

``plan()``, what it is asked and ``Plan`` (core.py, request.py, result.py), the prober that
measures real windows (prober.py), the run's other parts measured beside the window
(phases.py), the sizes that fit timed against each other (speed.py), a plan as another
framework's settings (exports.py) and a pipeline's number of micro-batches (pipeline.py).

``gradaccum.planning`` is also the name of the function ``ga.plan``: the package's own
``__init__`` (gradaccum/__init__.py) keeps ``gradaccum.planning`` the function when this package
loads; import what you need from here by name (``from gradaccum.planning import Plan``).
"""

from gradaccum.planning.core import CHECKPOINTING, plan, too_small
from gradaccum.planning.exports import FRAMEWORKS, Export, equal_split, export
from gradaccum.planning.pipeline import PipelinePlan, measure_stage, plan_micro_batches
from gradaccum.planning.request import PlanRequest
from gradaccum.planning.result import Fit, Phase, Plan, Probe, signed_bytes
from gradaccum.planning.speed import PREFER, Timing

__all__ = [
    "CHECKPOINTING",
    "FRAMEWORKS",
    "PREFER",
    "Export",
    "Fit",
    "Phase",
    "PipelinePlan",
    "Plan",
    "PlanRequest",
    "Probe",
    "Timing",
    "equal_split",
    "export",
    "measure_stage",
    "plan",
    "plan_micro_batches",
    "signed_bytes",
    "too_small",
]
