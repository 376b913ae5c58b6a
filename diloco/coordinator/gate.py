"""The checks every call to the coordinator passes, under its lock: the coordinator has not
failed, θ₀ is set, the caller is a member (each call of a site is a heartbeat), and no commit
is between its computation and its publication. It also holds the coordinator's health: once
a commit cannot be made durable (or the ticker breaks), every call is refused."""

from __future__ import annotations

import threading

from diloco.coordinator.round_book import Phase, RoundBook
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shards import ShardSet
from diloco.errors import CoordinatorError
from diloco.security.ids import site_id_problem


class Gate:
    def __init__(self, cv: threading.Condition, sessions: Sessions, book: RoundBook, shard: ShardSet) -> None:
        self.cv = cv
        self._sessions, self._book, self._shard = sessions, book, shard
        self.failed: str | None = None  # what failed; every call is refused from then on

    def fail(self, what: str, e: BaseException) -> None:
        """Under the lock: the coordinator has failed (the first failure is the one named)."""
        self.failed = self.failed or f"{what} failed: {type(e).__name__}: {str(e)[:500]}"
        self.cv.notify_all()

    def healthy(self) -> None:
        if self.failed is not None:
            raise CoordinatorError("unavailable", f"the coordinator has failed ({self.failed}) and must be restarted from its checkpoint; try again later")

    def ready(self) -> None:
        if not self._shard.ready:
            raise CoordinatorError("failed_precondition", "θ₀ is not set yet (init=site): the site chosen at Join must upload it first")

    def member(self, site_id: str) -> None:
        """Every call of a site counts as a heartbeat; an unknown, evicted or departed site is refused."""
        self.healthy()
        why = site_id_problem(site_id)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)
        self._sessions.renew(site_id)

    def published(self) -> None:
        """Waits (holding the lock) until no commit is between its computation and its publication."""
        self.cv.wait_for(lambda: self._book.phase == Phase.OPEN or self.failed is not None)
        self.healthy()
