"""The coordinator's Prometheus metrics (docs/observability.md lists each one).

Three sources, none of them counted twice: the gRPC server tells every call (this object is
its ``observer``, diloco.transport.observed); every commit comes as a RoundRecord
(``Coordinator.on_commit``) with its timings (``Coordinator.commit_timings``); gauges are read
from the coordinator when scraped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.observe.prom import DURATION_BUCKETS, new_registry
from diloco.observe.watched import CommitRecord, WatchedCoordinator

PREFIX = "diloco_coordinator_"
PULLS = {"PullUpdate": "update", "PullGlobal": "global"}
# A refused push's reason: the outcome the transport saw, with the protocol's meaning where it
# has one (diloco.coordinator.verdict); the other outcomes keep their gRPC status's name.
REASONS = {"aborted": "late", "out_of_range": "past_end", "duplicate": "duplicate"}
NORM_BOUND = "norm_bound"  # received whole, then not counted by the norm bound (robust.norm_ratio)
WITHHELD = "withheld"  # the site had no Δ for the round and said so (PushHeader.withheld)


def refusal_reason(outcome: str) -> str:
    return REASONS.get(outcome, outcome)


class CoordinatorMetrics:
    """The metrics of one coordinator process, in a registry of its own (``registry``)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry if registry is not None else new_registry()
        r, p = self.registry, PREFIX
        self.rounds_committed = Counter(p + "rounds_committed", "Rounds this process committed (rejected ones too)", registry=r)
        self.rounds_rejected = Counter(p + "rounds_rejected", "Committed rounds that were rejected: θ did not move (the guard, a non-finite step)", registry=r)
        self.tokens = Counter(p + "tokens", "Tokens of the pushes counted in the rounds this process committed", registry=r)
        self.open_round = Gauge(p + "open_round", "The round open for pushes (= rounds committed over the whole run)", registry=r)
        self.rounds_planned = Gauge(p + "rounds_planned", "Rounds this run commits in all", registry=r)
        self.finished = Gauge(p + "finished", "1 once the last round is committed", registry=r)
        self.sites = Gauge(p + "sites", "Sites by membership state (active, evicted, left)", ["state"], registry=r)
        self.pushes_accepted = Counter(p + "pushes_accepted", "Pushes taken into a round (or merged into a later one)", registry=r)
        self.pushes_refused = Counter(p + "pushes_refused", "Pushes not counted, by reason (docs/observability.md)", ["reason"], registry=r)
        self.rpcs = Counter(p + "rpcs", "gRPC calls by method and outcome", ["method", "outcome"], registry=r)
        self.received = Counter(
            p + "received_bytes", "Bytes of the request messages received, by method (serialized; HTTP/2 framing excluded)", ["method"], registry=r
        )
        self.sent = Counter(p + "sent_bytes", "Bytes of the response messages sent, by method (serialized; HTTP/2 framing excluded)", ["method"], registry=r)
        self.push_seconds = Histogram(p + "push_duration_seconds", "Seconds of a push call, first byte to reply", registry=r, buckets=DURATION_BUCKETS)
        self.pull_seconds = Histogram(
            p + "pull_duration_seconds", "Seconds of a pull call (update: a round's update; global: θ whole)", ["what"], registry=r, buckets=DURATION_BUCKETS
        )
        self.round_seconds = Histogram(p + "round_duration_seconds", "Seconds from a round's opening to its commit", registry=r, buckets=DURATION_BUCKETS)
        self.commit_seconds = Histogram(
            p + "commit_duration_seconds", "Seconds of a commit under the lock (mean Δ, outer step, encoding the update)", registry=r, buckets=DURATION_BUCKETS
        )
        self.checkpoint_seconds = Histogram(
            p + "checkpoint_duration_seconds", "Seconds to make a commit durable (its checkpoint written and synced)", registry=r, buckets=DURATION_BUCKETS
        )
        for state in ("active", "evicted", "left"):
            self.sites.labels(state)  # present (at 0) before the first site joins
        for reason in ("late", "duplicate", NORM_BOUND, WITHHELD):
            self.pushes_refused.labels(reason)
        self._coordinator: WatchedCoordinator | None = None

    # ---- the coordinator -------------------------------------------------------------
    def attach(self, coordinator: WatchedCoordinator) -> None:
        """Reads the gauges from ``coordinator`` (a diloco.coordinator.Coordinator: this
        package sits below it, and only reads it) and counts its commits."""
        self._coordinator = coordinator
        self.open_round.set_function(lambda: coordinator.committed_rounds)
        self.rounds_planned.set(coordinator.cfg.total_rounds)
        self.finished.set_function(lambda: 1.0 if coordinator.finished else 0.0)
        for state in ("active", "evicted", "left"):
            self.sites.labels(state).set_function(lambda state=state: coordinator.site_counts()[state])
        coordinator.on_commit.append(self.on_commit)

    def on_commit(self, record: CommitRecord) -> None:
        """A commit's diloco.coordinator.commit.RoundRecord."""
        self.rounds_committed.inc()
        self.tokens.inc(record.tokens)
        self.round_seconds.observe(record.wall_s)
        if record.rejected:
            self.rounds_rejected.inc()
        if record.refused:
            self.pushes_refused.labels(NORM_BOUND).inc(len(record.refused))
        if record.withheld:
            self.pushes_refused.labels(WITHHELD).inc(len(record.withheld))
        timings = self._coordinator.commit_timings()[-1:] if self._coordinator is not None else []
        if timings and timings[0].get("round") == record.round:
            self._timed(timings[0])

    def _timed(self, t: Mapping[str, Any]) -> None:
        if "commit_s" in t:
            self.commit_seconds.observe(float(t["commit_s"]))
        if "checkpoint_s" in t and self._coordinator is not None and self._coordinator.cfg.checkpoint_dir is not None:
            self.checkpoint_seconds.observe(float(t["checkpoint_s"]))

    # ---- the gRPC server's calls (diloco.transport.observed.CallObserver) --------------
    def call_done(self, method: str, outcome: str, seconds: float) -> None:
        self.rpcs.labels(method, outcome).inc()
        if method == "PushDelta":
            self.push_seconds.observe(seconds)
            if outcome == "ok":
                self.pushes_accepted.inc()
            else:
                self.pushes_refused.labels(refusal_reason(outcome)).inc()
        elif method in PULLS:
            self.pull_seconds.labels(PULLS[method]).observe(seconds)

    def bytes_received(self, method: str, n: int) -> None:
        self.received.labels(method).inc(n)

    def bytes_sent(self, method: str, n: int) -> None:
        self.sent.labels(method).inc(n)
