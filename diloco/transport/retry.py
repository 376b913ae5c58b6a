"""Retrying calls to a coordinator that cannot be reached (restarting, or a network failure):
exponential backoff for a bounded time. The only place that decides what is worth retrying
is ``RemoteError.retryable``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from diloco.errors import RemoteError

T = TypeVar("T")


class Backoff:
    """Waits 0.25 s, doubling to 4 s, for at most ``limit_s`` in all; then gives up by
    raising the last error."""

    def __init__(self, limit_s: float, log: Callable[[str], None] | None = None) -> None:
        self._give_up_at = time.monotonic() + limit_s
        self._delay = 0.25
        self._log = log or (lambda _m: None)
        self.tries = 0

    def wait(self, error: RemoteError, what: str) -> None:
        """Sleeps before the next try, or raises ``error`` when the time is up."""
        if time.monotonic() + self._delay > self._give_up_at:
            raise error
        if self.tries == 0:
            self._log(f"{what}: {error}; retrying with backoff")
        self.tries += 1
        time.sleep(self._delay)
        self._delay = min(2 * self._delay, 4.0)


def retrying(fn: Callable[[], T], *, limit_s: float, what: str, log: Callable[[str], None] | None = None, on_retry: Callable[[], None] | None = None) -> T:
    """``fn()``, made again with backoff while it fails with a retryable RemoteError, for at
    most ``limit_s``; any other error, or the last retryable one, is raised."""
    backoff = Backoff(limit_s, log)
    while True:
        try:
            return fn()
        except RemoteError as e:
            if not e.retryable:
                raise
            if on_retry is not None:
                on_retry()
            backoff.wait(e, what)
