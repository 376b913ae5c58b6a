"""The settings of TensorBoard (a run key: every process of a run writes or none does) and of
a process's Prometheus endpoint (each process its own: the coordinator's and each site's
``metrics`` section). Every check names the field it refuses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from diloco.fields import setting

MAX_PORT = 65535
T = TypeVar("T")


@dataclass(frozen=True)
class TensorBoardConfig:
    """The run's ``tensorboard`` section (docs/observability.md); read with
    ``tensorboard --logdir <run dir>/tb``."""

    enabled: bool = setting(
        True,
        doc="the coordinator writes <run dir>/tb/coordinator (a point per committed round), each site tb/site-<id> (per inner step and round); false: no event files",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"tensorboard.enabled={self.enabled!r}: must be true or false")


@dataclass(frozen=True)
class EndpointConfig:
    """An HTTP endpoint's section (``SECTION``). Every check names the field."""

    SECTION: ClassVar[str] = "endpoint"
    OFF: ClassVar[str] = "off"  # what port=null means, in the error message

    port: int | None = setting(None, doc="the port it listens on: 0 any free one (logged, and written to port_file); null: off; a port in use fails the start")
    host: str = setting("127.0.0.1", doc="the address it listens on (127.0.0.1: this machine only)")
    port_file: str | None = setting(None, doc="where the endpoint's address is written as JSON (useful with port=0); null: nowhere")

    def __post_init__(self) -> None:
        check_endpoint(self.SECTION, self.port, self.host, self.port_file, off=self.OFF)

    @property
    def enabled(self) -> bool:
        return self.port is not None


@dataclass(frozen=True)
class MetricsConfig(EndpointConfig):
    """One process's Prometheus endpoint (``GET /metrics``, prometheus_client's HTTP server):
    the ``metrics`` section of diloco-coordinator and diloco-site."""

    SECTION: ClassVar[str] = "metrics"
    OFF: ClassVar[str] = "no /metrics"

    host: str = setting(
        "127.0.0.1",
        doc="the address it listens on; off loopback the coordinator's is HTTPS asking for a run CA client certificate (security.dir), others need security.insecure",
    )
    port_file: str | None = setting(None, doc='where {"host", "port", "url"} of the endpoint is written as JSON (useful with port=0); null: nowhere')


def check_port(port: Any, field: str, off: str = "no /metrics") -> None:
    """None (off) or an integer port in 0..65535 (0: any free one)."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ValueError(f"{field}={port!r}: must be null ({off}), 0 (any free port) or a port in 1..{MAX_PORT}")


def check_endpoint(name: str, port: Any, host: Any, port_file: Any, off: str) -> None:
    """The checks of an HTTP endpoint's section ``name`` (port, host, port_file), naming the field."""
    check_port(port, f"{name}.port", off)
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"{name}.host={host!r}: must be a host name or address (127.0.0.1: this machine only)")
    if port_file is not None and (not isinstance(port_file, str) or not port_file):
        raise ValueError(f"{name}.port_file={port_file!r}: must be null or a file path")


def parse_section(cls: type[T], name: str, values: Mapping[str, Any] | None, **extra: Any) -> T:
    """The section ``name`` (plain data, plus ``extra``) as the dataclass ``cls``; unknown keys
    are named with the ones it knows."""
    values = {**dict(values or {}), **extra}
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(name + '.' + k for k in unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def metrics_config(values: Mapping[str, Any] | None, **extra: Any) -> MetricsConfig:
    """The ``metrics`` section (plain data) as a MetricsConfig; unknown keys are named."""
    return parse_section(MetricsConfig, "metrics", values, **extra)
