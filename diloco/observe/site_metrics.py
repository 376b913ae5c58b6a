"""A site's Prometheus metrics (docs/observability.md lists each one): its inner steps as they
run, each outer sync's time split as it lands, and the counts its outer sync and round loop
keep anyway (reconnects, stalls, bytes), read when scraped."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

from diloco.observe.prom import DURATION_BUCKETS, LiveCounter, new_registry
from diloco.observe.tensorboard import SYNC_PARTS
from diloco.observe.watched import WatchedLoop, WatchedSync

PREFIX = "diloco_site_"
RATE_WINDOW = 20  # tokens/s over the last this many inner steps


class SiteMetrics:
    """The metrics of one site process, in a registry of its own (``registry``)."""

    def __init__(self, site_id: str, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram, Info

        self.registry = registry if registry is not None else new_registry()
        r, p = self.registry, PREFIX
        Info("diloco_site", "Which site this process is", registry=r).info({"site_id": site_id})
        self.step_seconds = Histogram(
            p + "inner_step_duration_seconds", "Seconds of an inner step (forward, backward, optimizer)", registry=r, buckets=DURATION_BUCKETS
        )
        self.tokens = Counter(p + "tokens", "Tokens this process trained on (every inner step, counted or not)", registry=r)
        self.tokens_per_second = Gauge(p + "tokens_per_second", f"Tokens per second of inner steps, over the last {RATE_WINDOW} steps", registry=r)
        self.inner_loss = Gauge(p + "inner_loss", "Loss of the last inner step, nats per token", registry=r)
        self.learning_rate = Gauge(p + "learning_rate", "Inner learning rate of the last step", registry=r)
        self.rounds = Counter(p + "rounds", "Rounds of this site that landed (the update applied, or a dropped push caught up)", registry=r)
        self.round = Gauge(p + "round", "The last round of this site that landed", registry=r)
        self.sync_seconds = Histogram(
            p + "outer_sync_duration_seconds",
            "Seconds of each part of an outer sync (delta, encode, push, wait, pull, apply)",
            ["part"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self._window: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_WINDOW)
        self._sync: WatchedSync | None = None  # the site's OuterSync (its stats), once it has joined
        self._loop: WatchedLoop | None = None  # its RoundLoop (its stats)

        def live(name: str, doc: str, read: Callable[[WatchedSync, WatchedLoop | None], float]) -> None:
            LiveCounter(r, p + name, doc, lambda: read(self._sync, self._loop) if self._sync is not None else 0.0)

        live("reconnects", "Calls retried because the coordinator could not be reached", lambda s, _l: s.stats.reconnects)
        live("rejoins", "Times this site had to join again (evicted, or a restarted coordinator forgot it)", lambda s, _l: s.stats.rejoins)
        live("dropped_rounds", "Rounds committed without this site's push (it came too late)", lambda s, _l: len(s.stats.dropped_rounds))
        live("sent_bytes", "Payload bytes pushed (pseudo-gradients, encoded)", lambda s, _l: s.stats.bytes_up)
        live("received_bytes", "Payload bytes pulled (updates and θ, encoded)", lambda s, _l: s.stats.bytes_down)
        live("sync_stall_seconds", "Seconds the inner loop waited on outer syncs", lambda _s, loop: loop.stats.stall_s if loop is not None else 0.0)
        live("sync_stalls", "Overlapped syncs that had not landed when their merge was due", lambda _s, loop: loop.stats.stalls if loop is not None else 0)
        for part in SYNC_PARTS:
            self.sync_seconds.labels(part.removesuffix("_s"))

    def watch(self, sync: WatchedSync, loop: WatchedLoop | None = None) -> None:
        """Reads the live counts from ``sync`` (an OuterSync) and ``loop`` (its RoundLoop)."""
        self._sync, self._loop = sync, loop

    def step(self, loss: float, lr: float, step_s: float, tokens: int) -> None:
        self.step_seconds.observe(step_s)
        self.tokens.inc(tokens)
        self.inner_loss.set(loss)
        self.learning_rate.set(lr)
        self._window.append((tokens, step_s))
        seconds = sum(s for _, s in self._window)
        if seconds > 0:
            self.tokens_per_second.set(sum(t for t, _ in self._window) / seconds)

    def landed(self, round: int, times: Mapping[str, float]) -> None:
        """A round landed; ``times``: its seconds per part (OuterSync.stats.timings' entry)."""
        self.rounds.inc()
        self.round.set(round)
        for part in SYNC_PARTS:
            if part in times:
                self.sync_seconds.labels(part.removesuffix("_s")).observe(float(times[part]))
