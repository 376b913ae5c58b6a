"""The control plane's sessions: which sites are in the run (their leases: membership.py),
which left and with what hash of θ, which may join at all (the run's issued ids, or at most
``max_sites``), the election of the site that sends θ₀ (init=site), the barrier a fresh run's
first pulls wait at, and the sites' evaluations. No tensors; takes no lock (the coordinator
holds its lock around every call)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.init_source import InitElection
from diloco.coordinator.membership import Membership
from diloco.coordinator.site_evals import SiteEvals
from diloco.coordinator.start_barrier import StartBarrier
from diloco.errors import CoordinatorError
from diloco.types import SiteEval

RESTART_GRACE_S = 10.0  # added to the restored members' first lease after a restart


class Sessions:
    def __init__(self, cfg: CoordinatorConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._allowed, self._max_sites = cfg.sites, cfg.max_sites
        self.members = Membership(cfg.quorum.lease_s, clock)
        self.left: dict[str, str] = {}  # site id -> the hash it reported when leaving
        self.election = InitElection(cfg.quorum.lease_s, clock)
        expected = len(cfg.sites) if cfg.sites is not None else cfg.max_sites
        self.barrier = StartBarrier(expected, cfg.quorum.start_wait_s)  # round 0 starts when every site is in
        self.evals = SiteEvals()  # evaluation by the sites

    def check_admissible(self, site_id: str) -> None:
        """Only the run's configured ids (or, without a list, up to ``max_sites`` ids) may join."""
        if self._allowed is not None and site_id not in self._allowed:
            raise CoordinatorError("permission_denied", f"site {site_id!r} is not one of this run's sites ({', '.join(self._allowed)})")
        known = self.members.known
        if self._allowed is None and self._max_sites is not None and site_id not in known and len(known) >= self._max_sites:
            raise CoordinatorError(
                "permission_denied", f"this run has {self._max_sites} site(s), all taken ({', '.join(sorted(known))}); site {site_id!r} may not join"
            )

    def admit(self, site_id: str) -> None:
        self.members.join(site_id)
        self.left.pop(site_id, None)

    def renew(self, site_id: str) -> None:
        """The site's lease again (failed_precondition for an unknown, evicted or departed site)."""
        try:
            self.members.renew(site_id)
        except KeyError as e:
            raise CoordinatorError("failed_precondition", e.args[0]) from None

    def leave(self, site_id: str, global_sha256: str) -> None:
        if self.members.state(site_id) is None:
            raise CoordinatorError("failed_precondition", self.members.why_not_active(site_id))
        self.members.leave(site_id)
        self.left[site_id] = global_sha256

    def check_eval(self, site_id: str, e: SiteEval, committed: int) -> None:
        why = SiteEvals.problem(site_id, e, committed)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)

    def states(self, now: float, pushed_at: Mapping[str, float]) -> dict[str, dict[str, Any]]:
        """Site -> {"state": active | evicted | left, "joins", "pushed_s_ago": seconds since its
        push into the open round arrived, or None}."""
        return {s: {**m, "pushed_s_ago": now - pushed_at[s] if s in pushed_at else None} for s, m in self.members.snapshot().items()}

    def checkpoint(self) -> dict[str, Any]:
        return {"members": self.members.snapshot()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """A restored run's sites: active ones get a fresh lease (they reconnect with backoff, at
        most 4 s apart, while the process starts serving); the start barrier is open."""
        self.barrier.open = True
        self.members.restore(state["members"], grace_s=RESTART_GRACE_S)
