"""DiLoCo outer-loop math: pseudo-gradients, their weighted mean, and the outer step.

Imports only torch. Parameters are dicts name -> float32 tensor.
"""

from diloco.outer.aggregate import AGGREGATES, WeightedMean, check_aggregate
from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.error_feedback import ErrorFeedback
from diloco.outer.optimizer import OuterConfig, OuterOptimizer
from diloco.outer.pseudo_gradient import apply_update, params_sha256, pseudo_gradient

__all__ = ["AGGREGATES", "DelayedNesterov", "ErrorFeedback", "OuterConfig", "OuterOptimizer", "WeightedMean", "apply_update", "check_aggregate", "params_sha256", "pseudo_gradient"]
