"""DiLoCo outer-loop math: pseudo-gradients, their weighted mean, and the outer step.

Imports only torch. Parameters are dicts name -> float32 tensor.
"""

from diloco.outer.aggregate import AGGREGATES, WeightedMean, check_aggregate
from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.error_feedback import ErrorFeedback
from diloco.outer.optimizer import OuterConfig, OuterOptimizer, OuterStepRefused, averaged_from, check_update, l2
from diloco.outer.pseudo_gradient import apply_update, nonfinite_count, params_sha256, pseudo_gradient
from diloco.outer.robust import NormBound, NormVerdict, RobustConfig, StackedAggregate, delta_norm, make_aggregate, robust_config, stacked_bytes
from diloco.outer.schedule import OuterSchedule

__all__ = [
    "AGGREGATES",
    "DelayedNesterov",
    "ErrorFeedback",
    "OuterConfig",
    "OuterOptimizer",
    "OuterStepRefused",
    "WeightedMean",
    "apply_update",
    "averaged_from",
    "check_aggregate",
    "check_update",
    "l2",
    "nonfinite_count",
    "params_sha256",
    "pseudo_gradient",
]
__all__ += ["OuterSchedule", "NormBound", "NormVerdict", "RobustConfig", "StackedAggregate", "delta_norm", "make_aggregate", "robust_config", "stacked_bytes"]
