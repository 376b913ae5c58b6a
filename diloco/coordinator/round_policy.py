"""When a round closes: every active site has pushed, or a quorum has and the deadline passed.

Pure functions of times (monotonic seconds) and sets, so the policy is tested without a
clock or a server. The deadline is measured from the round's opening:

* ``none``: no deadline; the round waits for every active site (leases still evict the dead);
* ``fixed``: ``deadline_s`` seconds after the round opened;
* ``median``: ``deadline_factor`` times the median push time (opening to arrival) of the
  pushes in so far, so a site ``deadline_factor`` times slower than the typical one is left
  out, whatever the absolute round time is. Undefined until the quorum is in.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Set
from dataclasses import dataclass

from diloco.fields import setting

DEADLINES = ("none", "fixed", "median")
LATE_POLICIES = ("drop", "merge")
WITHHELD_POLICIES = ("skip", "zero")


@dataclass(frozen=True)
class QuorumConfig:
    """The run config's ``quorum`` section: who a round waits for (the coordinator's own
    coordinator.min_sites overrides min_sites)."""

    lease_s: float = setting(60.0, doc="a site silent this many seconds (no call, no heartbeat) is evicted until it joins again")
    min_sites: int | None = setting(
        None,
        doc="a round never closes with fewer pushes; null: a majority of the sites (sites // 2 + 1), so a run goes on without a dead site once its lease ends",
    )
    deadline: str = setting(
        "none",
        doc="none: wait for every active site | fixed: deadline_s after the round opens | median: deadline_factor × the median push time, once the quorum is in",
    )
    deadline_s: float = setting(60.0, doc="deadline=fixed: seconds from the round's opening to its deadline")
    deadline_factor: float = setting(
        1.5, doc="deadline=median: the deadline as a multiple (>= 1) of the median push time (opening to arrival) of the pushes in"
    )
    late: str = setting("drop", doc="a push for a round that closed without it: drop (refused; the site pulls θ) | merge (into the open round)")
    late_discount: float = setting(0.5, doc="late=merge: a late push weighs tokens × late_discount ** rounds late, in (0, 1]")
    max_staleness: int = setting(2, doc="late=merge: a push more than this many rounds late is dropped all the same")
    withheld: str = setting(
        "skip",
        doc="a site with no Δ for a round: skip (the mean of the Δ received) | zero (a zero Δ with its tokens: the step shrinks with the share lost; only with aggregate=mean)",
    )
    # Which sites make round 0 must not depend on which process started first.
    start_wait_s: float = setting(
        60.0,
        doc="a fresh run's first pull of θ waits until every site has asked, or this many seconds after the first did, so all start round 0 together; 0: off",
    )

    def __post_init__(self) -> None:
        if self.late not in LATE_POLICIES:
            raise ValueError(f"quorum.late={self.late!r}: must be one of {', '.join(LATE_POLICIES)}")
        if self.withheld not in WITHHELD_POLICIES:
            raise ValueError(f"quorum.withheld={self.withheld!r}: must be one of {', '.join(WITHHELD_POLICIES)}")
        if not 0 < self.late_discount <= 1:
            raise ValueError(f"quorum.late_discount={self.late_discount}: must be in (0, 1]")
        if not (isinstance(self.max_staleness, int) and self.max_staleness >= 1):
            raise ValueError(f"quorum.max_staleness={self.max_staleness!r}: must be an integer >= 1")
        if not self.lease_s > 0:
            raise ValueError(f"quorum.lease_s={self.lease_s}: must be > 0")
        if not (isinstance(self.start_wait_s, int | float) and 0 <= self.start_wait_s < float("inf")):
            raise ValueError(f"quorum.start_wait_s={self.start_wait_s!r}: must be a number of seconds >= 0 (0: no start barrier)")
        if self.min_sites is not None and not (isinstance(self.min_sites, int) and self.min_sites >= 1):
            raise ValueError(f"quorum.min_sites={self.min_sites!r}: must be null or an integer >= 1")
        RoundPolicy(deadline=self.deadline, deadline_s=self.deadline_s, deadline_factor=self.deadline_factor)


@dataclass(frozen=True)
class RoundPolicy:
    min_sites: int = 1  # a round never closes with fewer pushes than this
    deadline: str = "none"
    deadline_s: float = 60.0  # fixed
    deadline_factor: float = 1.5  # median

    def __post_init__(self) -> None:
        if self.min_sites < 1:
            raise ValueError(f"min_sites={self.min_sites}: must be >= 1")
        if self.deadline not in DEADLINES:
            raise ValueError(f"deadline={self.deadline!r}: must be one of {', '.join(DEADLINES)}")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s={self.deadline_s}: must be > 0")
        if not self.deadline_factor >= 1:
            raise ValueError(f"deadline_factor={self.deadline_factor}: must be >= 1")

    def deadline_at(self, opened_at: float, pushed_at: Mapping[str, float]) -> float | None:
        """The round's deadline (monotonic seconds), or None when there is none (yet)."""
        if self.deadline == "fixed":
            return opened_at + self.deadline_s
        if self.deadline == "median" and len(pushed_at) >= self.min_sites:
            return opened_at + self.deadline_factor * statistics.median(t - opened_at for t in pushed_at.values())
        return None

    def should_close(self, now: float, opened_at: float, pushed_at: Mapping[str, float], active: Set[str]) -> bool:
        """True when the round can commit with the sites in ``pushed_at``."""
        if len(pushed_at) < self.min_sites:
            return False
        if active <= pushed_at.keys():
            return True
        deadline = self.deadline_at(opened_at, pushed_at)
        return deadline is not None and now >= deadline
