"""The standard gRPC health service (grpc.health.v1.Health, from grpcio-health-checking) and,
behind a switch, server reflection (grpcio-reflection), on the coordinator's server.

Health answers for the whole server ("") and for the coordinator's service by name
(``diloco.Coordinator``): SERVING while the coordinator takes rounds, NOT_SERVING once its
last round is committed, when it has failed, and while it stops. It restores its checkpoint
before its port opens, so a probe meanwhile finds nothing listening (UNAVAILABLE).

Neither service asks for a site's token: a probe (a load balancer, Kubernetes, grpc_health_probe)
holds none, and the answers say nothing about the run but whether it serves. TLS is the
server's, as for every call: with mutual TLS (security.auth=mtls or both) the handshake still
needs a certificate of the run's CA.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diloco.transport.pb import coordinator_pb2 as pb

COORDINATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
HEALTH_SERVICE = health.SERVICE_NAME


class Health:
    """The health service of one server; ``set_serving`` moves every name it answers for."""

    def __init__(self, serving: bool = True) -> None:
        self._servicer = health.HealthServicer()
        self._lock = threading.Lock()
        self._serving: bool | None = None
        self.set_serving(serving)

    def register(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set_serving(self, serving: bool) -> None:
        """Watchers are told a change, not every call (the coordinator calls it every commit)."""
        with self._lock:
            if serving == self._serving:
                return
            self._serving = serving
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in (health.OVERALL_HEALTH, COORDINATOR_SERVICE):
                self._servicer.set(name, status)

    def shutdown(self) -> None:
        """NOT_SERVING for good (the server is stopping); later set_serving calls are ignored."""
        self._servicer.enter_graceful_shutdown()


def enable_reflection(server: grpc.Server) -> None:
    """Server reflection: lists the coordinator's, the health and the reflection services and
    their schemas to tools such as grpcurl."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection((COORDINATOR_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
