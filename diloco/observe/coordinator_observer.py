"""What the coordinator process shows: TensorBoard scalars (tb/coordinator), fed by the same
lines as metrics.jsonl, and its Prometheus endpoint; each on or off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco.observe.config import MetricsConfig, TensorBoardConfig
from diloco.observe.coordinator_metrics import CoordinatorMetrics
from diloco.observe.prom import MetricsEndpoint, metrics_tls, serve_metrics
from diloco.observe.tensorboard import RunBoard
from diloco.observe.watched import WatchedCoordinator
from diloco.run_dir import RunDir
from diloco.security.config import SecurityConfig


def written_lines(path: Path) -> list[dict[str, Any]]:
    """The lines a metrics.jsonl holds, read leniently (a killed coordinator may have torn its last)."""
    out = []
    if path.exists():
        for raw in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


class CoordinatorObserver:
    def __init__(self, board: RunBoard | None = None, metrics: CoordinatorMetrics | None = None, endpoint: MetricsEndpoint | None = None) -> None:
        self.board, self.metrics, self.endpoint = board, metrics, endpoint

    @classmethod
    def start(
        cls, tensorboard: TensorBoardConfig, metrics: MetricsConfig, run_dir: Path, log: Callable[[str], None], security: SecurityConfig | None = None
    ) -> CoordinatorObserver:
        """The endpoint first (a port in use fails here, before anything slow), then the board,
        which goes on from the lines metrics.jsonl already holds (a restarted coordinator)."""
        coordinator_metrics = endpoint = None
        if metrics.enabled:
            coordinator_metrics = CoordinatorMetrics()
            tls = metrics_tls(security or SecurityConfig(), metrics.host, "coordinator")
            endpoint = serve_metrics(coordinator_metrics.registry, metrics.host, int(metrics.port or 0), tls)
            if metrics.port_file:
                endpoint.write(Path(metrics.port_file))
            log(f"coordinator: Prometheus metrics on {endpoint.url}")
        rd = RunDir(run_dir)
        board = RunBoard(rd.tensorboard("coordinator"), earlier=written_lines(rd.metrics)) if tensorboard.enabled else None
        return cls(board, coordinator_metrics, endpoint)

    def attach(self, coordinator: WatchedCoordinator) -> None:
        """The diloco.coordinator.Coordinator the metrics read."""
        if self.metrics is not None:
            self.metrics.attach(coordinator)

    @property
    def line_listeners(self) -> list[Callable[[Any], None]]:
        """What MetricsReporter tells each line it writes to metrics.jsonl."""
        return [self.board.write] if self.board is not None else []

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.endpoint is not None:
            self.endpoint.close()
