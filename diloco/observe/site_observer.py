"""What a site process shows while it trains: TensorBoard scalars (tb/site-<id>) and its own
Prometheus endpoint, each on or off; the site calls ``step`` after each inner step and
``landed`` after each round, and never needs to know which of them are on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from diloco.observe.config import MetricsConfig, TensorBoardConfig
from diloco.observe.prom import MetricsEndpoint, metrics_tls, serve_metrics
from diloco.observe.site_metrics import SiteMetrics
from diloco.observe.tensorboard import SiteBoard
from diloco.observe.watched import WatchedLoop, WatchedSync
from diloco.run_dir import RunDir
from diloco.security.config import SecurityConfig


class SiteObserver:
    def __init__(self, board: SiteBoard | None = None, metrics: SiteMetrics | None = None, endpoint: MetricsEndpoint | None = None) -> None:
        self.board, self.metrics, self.endpoint = board, metrics, endpoint
        self._sync: WatchedSync | None = None
        self._loop: WatchedLoop | None = None
        self._step_s = 0.0  # seconds in inner steps so far
        self._first: float | None = None  # when the first inner step began (monotonic)

    @classmethod
    def start(
        cls,
        site_id: str,
        tensorboard: TensorBoardConfig,
        metrics: MetricsConfig,
        run_dir: Path,
        log: Callable[[str], None],
        security: SecurityConfig | None = None,
    ) -> SiteObserver:
        """The endpoint first (a port in use fails here, before any training), then the board."""
        site_metrics = endpoint = None
        if metrics.enabled:
            site_metrics = SiteMetrics(site_id)
            tls = metrics_tls(security or SecurityConfig(), metrics.host, "site")  # None: a site has no server certificate
            endpoint = serve_metrics(site_metrics.registry, metrics.host, int(metrics.port or 0), tls)
            if metrics.port_file:
                endpoint.write(Path(metrics.port_file))
            log(f"site {site_id}: Prometheus metrics on {endpoint.url}")
        board = SiteBoard(RunDir(run_dir).tensorboard(f"site-{site_id}")) if tensorboard.enabled else None
        return cls(board, site_metrics, endpoint)

    def watch(self, sync: WatchedSync, loop: WatchedLoop | None = None) -> None:
        """The site's OuterSync and RoundLoop, whose counts the metrics read."""
        self._sync, self._loop = sync, loop
        if self.metrics is not None:
            self.metrics.watch(sync, loop)

    def step(self, step: int, loss: float, lr: float, step_s: float, tokens: int) -> None:
        """Inner step ``step`` (0-based place in the lr schedule) took ``step_s`` on ``tokens``."""
        now = time.monotonic()
        if self._first is None:
            self._first = now - step_s
        self._step_s += step_s
        if self.board is not None:
            self.board.step(step, loss, lr, step_s)
        if self.metrics is not None:
            self.metrics.step(loss, lr, step_s, tokens)

    def landed(self, round: int, times: Mapping[str, float]) -> None:
        """Round ``round`` landed; ``times``: its seconds per part of the sync, and bytes."""
        if self.metrics is not None:
            self.metrics.landed(round, times)
        if self.board is not None:
            self.board.round(round, times, self._totals())

    def _totals(self) -> dict[str, float | None]:
        started = self._loop.stats.started if self._loop is not None and self._loop.stats.started else self._first
        span = time.monotonic() - started if started is not None else 0.0
        stats = self._sync.stats if self._sync is not None else None
        return {
            "compute_utilization": self._step_s / span if span > 0 else None,
            "stall_s": self._loop.stats.stall_s if self._loop is not None else None,
            "reconnects": float(stats.reconnects) if stats is not None else None,
            "dropped_rounds": float(len(stats.dropped_rounds)) if stats is not None else None,
        }

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.endpoint is not None:
            self.endpoint.close()
