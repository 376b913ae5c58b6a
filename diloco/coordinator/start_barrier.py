"""The start of a fresh run: round 0 begins when every site of the run has pulled θ₀.

Without it, which sites make round 0 depends on which processes started first: under the
default quorum (a majority) round 0 can close before a site slow to start has joined, and a
``median`` deadline counts a site's start-up against its push time. So every site's first
pull of θ waits here until all the run's sites (its ``sites`` list, else ``max_sites``) have
asked for it, or until ``quorum.start_wait_s`` after the first one did; then round 0 opens
for all of them at once. A run whose number of sites is not known, a restored run and a run
past round 0 have no barrier. Not thread-safe on its own: the coordinator calls it under its
lock, with its clock.
"""

from __future__ import annotations


class StartBarrier:
    def __init__(self, expected: int | None, wait_s: float) -> None:
        self.expected = expected
        self.wait_s = wait_s
        self.arrived: set[str] = set()
        self.first_at: float | None = None
        self.open = expected is None or wait_s <= 0

    def arrive(self, site_id: str, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        self.arrived.add(site_id)

    @property
    def opens_at(self) -> float:
        """When it opens whoever is missing (monotonic seconds; after the first arrival)."""
        assert self.first_at is not None
        return self.first_at + self.wait_s

    def release(self, now: float) -> bool:
        """Opens it if every site is in or the wait is over; True only on the call that opened it."""
        if self.open or self.first_at is None:
            return False
        assert self.expected is not None
        if len(self.arrived) >= self.expected or now >= self.opens_at:
            self.open = True
            return True
        return False

    def waiting_for(self) -> str:
        return f"{len(self.arrived)} of {self.expected} site(s) in ({', '.join(sorted(self.arrived))})"
