"""gRPC transport: the only package that imports grpc.

``serve`` puts any ``CoordinatorService`` (transport/protocol.py) behind a gRPC server;
``CoordinatorClient`` is what a site uses. Refusals travel as the project's kinds
(diloco.errors); ``retrying`` and ``Backoff`` retry what can be retried.
"""

import os

# grpc logs every failed TLS handshake at INFO by default: a coordinator on the internet would
# log one line per scanner. Errors only, unless the user asks for more.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from diloco.errors import RemoteError  # noqa: E402
from diloco.transport.client import CoordinatorClient, PullCall  # noqa: E402
from diloco.transport.limits import ServerLimits  # noqa: E402
from diloco.transport.protocol import CoordinatorService  # noqa: E402
from diloco.transport.retry import Backoff, retrying  # noqa: E402
from diloco.transport.server import Server, serve  # noqa: E402

__all__ = ["Backoff", "CoordinatorClient", "PullCall", "CoordinatorService", "RemoteError", "Server", "ServerLimits", "retrying", "serve"]
