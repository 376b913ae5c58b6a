"""gRPC transport: the only package that imports grpc.

``serve`` puts any ``CoordinatorService`` (transport/protocol.py) behind a gRPC server;
``CoordinatorClient`` is what a site uses. Refusals travel as the project's kinds
(diloco.errors); ``retrying`` and ``Backoff`` retry what can be retried.
"""

from diloco.errors import RemoteError
from diloco.transport.client import CoordinatorClient
from diloco.transport.protocol import CoordinatorService
from diloco.transport.retry import Backoff, retrying
from diloco.transport.limits import ServerLimits
from diloco.transport.server import Server, serve

__all__ = ["Backoff", "CoordinatorClient", "CoordinatorService", "RemoteError", "Server", "ServerLimits", "retrying", "serve"]
