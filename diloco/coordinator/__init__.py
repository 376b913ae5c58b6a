"""The coordinator: the single source of truth for θ, the outer optimizer and the rounds.

Pure Python + torch: the gRPC servicer in diloco/transport/ is a thin translation layer
over ``Coordinator``.
"""

from diloco.coordinator.errors import CoordinatorError
from diloco.coordinator.service import Coordinator, CoordinatorConfig, RoundRecord

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorError", "RoundRecord"]
