"""The coordinator: the single source of truth for θ, the outer optimizer and the rounds.

Pure Python + torch, and no transport: the gRPC server (diloco/transport/) serves anything
that has ``Coordinator``'s methods (transport/protocol.py).
"""

from diloco.coordinator.commit import RoundRecord
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.service import Coordinator
from diloco.errors import CoordinatorError

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorError", "RoundRecord"]
