"""Who takes part in the run: sites with leases that heartbeats renew.

A site that joins holds a lease of ``lease_s`` seconds; every heartbeat (and every call the
coordinator counts as one) renews it. A site whose lease ends is *evicted*: it is no longer
active, rounds stop waiting for it, and every call it makes is refused until it joins again.
A site that leaves is *left*. Not thread-safe on its own: the coordinator calls it under its
lock. The clock is injectable so leases can be tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["active", "evicted", "left"]


@dataclass
class Member:
    site_id: str
    state: State
    expires_at: float  # monotonic seconds; meaningful while active
    joins: int = 1  # how many times this id has joined (a rejoin after an outage counts)


class Membership:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s}: must be > 0")
        self.lease_s = lease_s
        self._clock = clock
        self._members: dict[str, Member] = {}

    def join(self, site_id: str) -> Member:
        """Adds a new site or takes back an evicted or departed one; renews its lease."""
        now = self._clock()
        m = self._members.get(site_id)
        if m is None:
            m = self._members[site_id] = Member(site_id, "active", now + self.lease_s)
        else:
            m.joins += m.state != "active"
            m.state, m.expires_at = "active", now + self.lease_s
        return m

    def renew(self, site_id: str) -> None:
        """Extends an active site's lease; KeyError (with the reason) for any other site."""
        m = self._members.get(site_id)
        if m is None or m.state != "active":
            raise KeyError(self.why_not_active(site_id))
        m.expires_at = self._clock() + self.lease_s

    def leave(self, site_id: str) -> None:
        m = self._members.get(site_id)
        if m is not None:
            m.state = "left"

    def expire(self) -> list[str]:
        """Evicts every active site whose lease has ended; returns their ids, sorted."""
        now = self._clock()
        gone = sorted(s for s, m in self._members.items() if m.state == "active" and m.expires_at <= now)
        for s in gone:
            self._members[s].state = "evicted"
        return gone

    def state(self, site_id: str) -> State | None:
        m = self._members.get(site_id)
        return None if m is None else m.state

    def why_not_active(self, site_id: str) -> str:
        state = self.state(site_id)
        if state is None:
            return f"site {site_id!r} has not joined; call Join first"
        if state == "evicted":
            return f"site {site_id!r} was evicted: no heartbeat for {self.lease_s:g} s; join again to take part"
        if state == "left":
            return f"site {site_id!r} has left the run; join again to take part"
        return f"site {site_id!r} is active"

    @property
    def active(self) -> frozenset[str]:
        return frozenset(s for s, m in self._members.items() if m.state == "active")

    @property
    def not_left(self) -> frozenset[str]:
        """Active or evicted: the sites that may still call (an evicted one to join again)."""
        return frozenset(s for s, m in self._members.items() if m.state != "left")

    @property
    def known(self) -> frozenset[str]:
        return frozenset(self._members)

    def counts(self) -> dict[str, int]:
        """How many sites are active, evicted and left."""
        states = [m.state for m in self._members.values()]
        return {state: states.count(state) for state in ("active", "evicted", "left")}

    def next_expiry(self) -> float | None:
        """When the earliest active lease ends (monotonic seconds), or None."""
        times = [m.expires_at for m in self._members.values() if m.state == "active"]
        return min(times) if times else None

    def restore(self, snapshot: dict[str, dict[str, object]], grace_s: float = 0.0) -> None:
        """Loads ``snapshot``; active sites get a fresh lease plus ``grace_s`` (they have that
        long to show up)."""
        expires = self._clock() + self.lease_s + grace_s
        self._members = {
            s: Member(s, str(d["state"]), expires, int(d["joins"]))  # type: ignore[arg-type]
            for s, d in snapshot.items()
        }

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Plain data for a checkpoint: state and join count per site (leases restart on load)."""
        return {s: {"state": m.state, "joins": m.joins} for s, m in sorted(self._members.items())}
