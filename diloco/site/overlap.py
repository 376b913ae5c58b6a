"""Rounds in flight: a round's exchange (push, wait, pull) on a background thread while the
site trains on (streaming's τ steps, a whole phase under sync.mode delayed/eager).

The inner loop blocks on the network only when a merge is due and its round has not landed
(``InFlight.land``), and counts that time as a stall.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from diloco.site.outer_sync import OuterSync, PendingRound


class InFlight:
    """Rounds' exchanges (push, wait, pull) running on background threads: one at a time while
    the site trains; at the end of a streaming run several, pipelined (``RoundLoop``'s tail)."""

    def __init__(self, sync: OuterSync, lanes: int = 1) -> None:
        self._sync = sync
        self._pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="site-sync")
        self._lanes = lanes
        self._rounds: deque[tuple[Future[PendingRound], threading.Event]] = deque()
        self.stall_s = 0.0  # the inner loop's wait for rounds that had not landed when due
        self.stalls = 0

    @property
    def busy(self) -> bool:
        return bool(self._rounds)

    @property
    def count(self) -> int:
        """Rounds in flight."""
        return len(self._rounds)

    def launch(self, pending: PendingRound) -> None:
        assert len(self._rounds) < self._lanes, f"at most {self._lanes} rounds in flight"
        committed = threading.Event()

        def run() -> PendingRound:
            try:
                return self._sync.exchange(pending, on_committed=committed.set)
            finally:
                committed.set()  # or it ended without a commit (refused, late, failed)

        self._rounds.append((self._pool.submit(run), committed))

    def committed(self) -> None:
        """Returns once the newest round in flight is committed (or its exchange ended), so the
        next round may be pushed: the coordinator has opened it."""
        self._rounds[-1][1].wait()

    def land(self) -> PendingRound:
        """The oldest round in flight, once its exchange is done (re-raising what it raised); the
        wait counts as a stall when it had not finished."""
        assert self._rounds, "no round in flight"
        future, _ = self._rounds.popleft()
        if not future.done():
            t = time.perf_counter()
            try:
                return future.result()
            finally:
                self.stall_s += time.perf_counter() - t
                self.stalls += 1
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
