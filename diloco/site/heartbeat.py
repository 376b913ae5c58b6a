"""A background thread that renews a site's lease while it trains and waits."""

from __future__ import annotations

import threading
from collections.abc import Callable

from diloco.transport import CoordinatorClient, RemoteError


class Heartbeat:
    """Calls ``client.heartbeat(site_id)`` every ``interval_s`` until ``stop``. A refused or
    failed heartbeat is logged once per kind of failure and retried at the next beat: the
    site finds out it was evicted at its next push, and rejoins then."""

    def __init__(self, client: CoordinatorClient, site_id: str, interval_s: float, log: Callable[[str], None]) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self._client = client
        self._site_id = site_id
        self._interval_s = interval_s
        self._log = log
        self._stop = threading.Event()
        self._last_error: str | None = None
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{site_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._client.heartbeat(self._site_id, timeout_s=self._interval_s)
                self.beats += 1
                self._last_error = None
            except RemoteError as e:
                if e.kind != self._last_error:
                    self._log(f"site {self._site_id}: heartbeat failed: {e}")
                self._last_error = e.kind
            except ValueError:  # the channel was closed under us: the site is shutting down
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5)
