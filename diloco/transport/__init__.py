"""gRPC transport: the only package that imports grpc.

``serve`` puts a Coordinator behind a gRPC server; ``CoordinatorClient`` is what a site uses.
"""

from diloco.transport.client import CoordinatorClient, RemoteError
from diloco.transport.server import serve

__all__ = ["CoordinatorClient", "RemoteError", "serve"]
