"""A process's Prometheus endpoint: prometheus_client's own HTTP server (``GET /metrics``)
over a registry of the process's own (never the library's global one, so that the tests and
several coordinators in one process do not mix their series), and the small pieces the
coordinator's and the sites' metrics share.
"""

from __future__ import annotations

import errno
import math
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.io import write_json_atomic
from diloco.security.config import SecurityConfig, is_loopback
from diloco.security.store import RunCredentials

# Seconds, for calls and commits that take from milliseconds (a tiny model on loopback) to
# minutes (a large model over a slow link).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, math.inf)


class MetricsEndpointError(ValueError):
    """The endpoint cannot listen where it was told to; the message names the field and port."""


@dataclass(frozen=True)
class MetricsTLS:
    """/metrics over HTTPS: the server's certificate and key, and the CA whose client
    certificate a scraper must show (None: none asked)."""

    certfile: str
    keyfile: str
    client_cafile: str | None = None


def metrics_tls(security: SecurityConfig, host: str, process: str) -> MetricsTLS | None:
    """How ``process``'s /metrics on ``host`` is served under the run's security settings.

    On loopback: plain HTTP (this machine's users only). Off loopback: the coordinator serves
    HTTPS with its own certificate when the run has TLS credentials, and asks every scraper
    for a client certificate of the run CA, whatever ``security.auth`` (prometheus_client's
    server checks no bearer token; Prometheus: ``tls_config`` with a site's certificate and
    key); plain HTTP only with ``security.insecure=true``. A site has no server
    certificate: off loopback, plain HTTP with ``security.insecure=true`` or nothing.
    MetricsEndpointError naming ``metrics.host`` where none of these applies."""
    if is_loopback(host):
        return None
    if process == "coordinator" and security.dir is not None and security.tls:
        creds = RunCredentials.at(security.dir)
        creds.coordinator_pem()  # a missing or bad file is named here
        creds.ca_pem()
        return MetricsTLS(str(creds.coordinator_cert), str(creds.coordinator_key), str(creds.ca_cert))
    if security.insecure:
        return None
    why = "the coordinator's needs the run's TLS credentials (security.dir)" if process == "coordinator" else "a site has no server certificate"
    raise MetricsEndpointError(f"metrics.host={host}: /metrics off loopback would be plain HTTP ({why}); keep it on 127.0.0.1, or set security.insecure=true")


@dataclass
class MetricsEndpoint:
    """A running /metrics endpoint; ``close`` stops it."""

    host: str
    port: int
    _server: Any
    _thread: Any
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def write(self, path: Path) -> None:
        """Writes {"host", "port", "url"} to ``path`` (JSON, atomically): where to scrape."""
        write_json_atomic(Path(path), {"host": self.host, "port": self.port, "url": self.url})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def new_registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry(auto_describe=True)


def in_use(port: int, field: str = "metrics.port", host: str = "127.0.0.1") -> MetricsEndpointError:
    return MetricsEndpointError(f"{field}={port}: {host}:{port} is already in use; choose another port, or 0 for any free one")


def check_port_free(host: str, port: int, field: str = "metrics.port") -> None:
    """Refuses (MetricsEndpointError naming ``field``) a port something listens on already;
    for a launcher that wants to fail before it starts the process that would listen there."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise in_use(port, field, host) from None
            raise MetricsEndpointError(f"{field}={port}: cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve_metrics(registry: Any, host: str, port: int, tls: MetricsTLS | None = None) -> MetricsEndpoint:
    """Starts prometheus_client's HTTP server for ``registry`` on ``host``:``port`` (0: any
    free port), over HTTPS with ``tls``; MetricsEndpointError naming the port when it is taken
    or the host unusable."""
    from prometheus_client import start_http_server

    https: dict[str, Any] = {}
    if tls is not None:
        https = {"certfile": tls.certfile, "keyfile": tls.keyfile, "client_cafile": tls.client_cafile, "client_auth_required": tls.client_cafile is not None}
    try:
        server, thread = start_http_server(port, addr=host, registry=registry, **https)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise in_use(port, host=host) from None
        raise MetricsEndpointError(f"metrics.host={host}, metrics.port={port}: cannot listen there: {e.strerror or e}") from None
    return MetricsEndpoint(host, int(server.server_address[1]), server, thread, tls=tls is not None)


class LiveCounter:
    """A counter whose value is read at scrape time from a count the process keeps anyway
    (a site's reconnects, its stall seconds): one source of truth, nothing to keep in step.
    ``name`` without ``_total``: the exposition adds it."""

    def __init__(self, registry: Any, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, documentation, read
        registry.register(self)

    def _family(self, value: float) -> Any:
        from prometheus_client.core import CounterMetricFamily

        return CounterMetricFamily(self._name, self._doc, value=value)

    def describe(self) -> Iterator[Any]:
        yield self._family(0.0)

    def collect(self) -> Iterator[Any]:
        yield self._family(float(self._read()))
