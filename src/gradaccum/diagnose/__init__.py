"""Know your large batch: the equivalence audit, and BatchNorm handling (gradaccum.batchnorm,
which lives below the engine: the engine warns of BatchNorm)."""

from gradaccum.batchnorm import (
    FrozenBatchNorm,
    batchnorm_modules,
    batchnorm_momentum,
    convert_batchnorm,
)
from gradaccum.diagnose.audit import AuditResult, audit
from gradaccum.diagnose.check import TOLERANCES, CheckResult, check

__all__ = [
    "TOLERANCES",
    "AuditResult",
    "audit",
    "CheckResult",
    "FrozenBatchNorm",
    "batchnorm_modules",
    "batchnorm_momentum",
    "check",
    "convert_batchnorm",
]
