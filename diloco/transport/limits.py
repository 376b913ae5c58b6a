"""What the server lets one caller hold: sizes both ends agree on, the number of concurrent
calls (in all and per site), and how long a stream may sit idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from diloco.errors import CoordinatorError

# Messages carry chunks of at most 1 MiB plus a small header; 4 MiB is gRPC's default too.
MAX_MESSAGE_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_rpcs: int = 128  # concurrent calls in all (= the worker threads); more are refused at once (resource_exhausted)
    max_rpcs_per_site: int = 32  # concurrent calls naming one site id (its ranks' pushes, pulls, waits, heartbeats)
    stream_idle_s: float = 30.0  # a stream that sends or takes no message this long is cancelled
    stream_max_s: float = 3600.0  # no stream lasts longer
    max_connection_idle_s: float = 600.0  # a connection with no call this long is closed

    def __post_init__(self) -> None:
        for name in ("max_rpcs", "max_rpcs_per_site"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"limits.{name}={value!r}: must be an integer >= 1")
        for name in ("stream_idle_s", "stream_max_s", "max_connection_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"limits.{name}={getattr(self, name)!r}: must be > 0")


class PerSite:
    """Counts the calls each site id has in flight; refuses one over the limit."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}

    @contextmanager
    def hold(self, site_id: str) -> Iterator[None]:
        with self._lock:
            n = self._calls.get(site_id, 0)
            if n >= self._limit:
                raise CoordinatorError("resource_exhausted", f"site {site_id!r} has {n} calls in flight, the most one site may have; call again shortly")
            self._calls[site_id] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._calls[site_id] - 1
                if left:
                    self._calls[site_id] = left
                else:
                    del self._calls[site_id]

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._calls.values())


class _Tracked:
    __slots__ = ("cancel", "last", "started")

    def __init__(self, cancel: Callable[[], object], now: float) -> None:
        self.cancel, self.last, self.started = cancel, now, now

    def touch(self) -> None:
        self.last = time.monotonic()


class StreamWatch:
    """Cancels streams that stay idle longer than ``idle_s`` (no message in either direction)
    or live longer than ``max_s``: a client that sends a header and then nothing, or never
    reads what it asked for, frees its thread and its staging buffer."""

    def __init__(self, idle_s: float, max_s: float, period_s: float = 0.25) -> None:
        self._idle_s, self._max_s, self._period_s = idle_s, max_s, period_s
        self._lock = threading.Lock()
        self._streams: set[_Tracked] = set()
        self.cancelled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stream-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def track(self, cancel: Callable[[], object]) -> Iterator[_Tracked]:
        """Watches one stream while the block runs; call ``touch()`` on every message."""
        t = _Tracked(cancel, time.monotonic())
        with self._lock:
            self._streams.add(t)
        try:
            yield t
        finally:
            with self._lock:
                self._streams.discard(t)

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            now = time.monotonic()
            with self._lock:
                late = [t for t in self._streams if now - t.last > self._idle_s or now - t.started > self._max_s]
                for t in late:
                    self._streams.discard(t)
            for t in late:
                self.cancelled += 1
                t.cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
