"""DiLoCo outer-loop math: pseudo-gradients, their weighted mean, and the outer step.

Imports only torch. Parameters are dicts name -> float32 tensor.
"""

from diloco.outer.aggregate import AGGREGATES, WeightedMean
from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.optimizer import OuterConfig, OuterOptimizer
from diloco.outer.pseudo_gradient import apply_update, params_sha256, pseudo_gradient

__all__ = ["AGGREGATES", "DelayedNesterov", "OuterConfig", "OuterOptimizer", "WeightedMean", "apply_update", "params_sha256", "pseudo_gradient"]
