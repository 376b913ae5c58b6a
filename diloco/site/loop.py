"""A site's rounds: inner phases and outer syncs, in the order its ``SyncSchedule`` says.

The trainer, the data and what follows each round (checkpoints, logs, evaluation) are the
caller's, given as functions; this module owns only the order of steps, pushes and merges,
and the time the inner loop spent waiting on the network. So the simulation's sites, a
user's own loop and the tests run exactly the same schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.site.freeze import FrozenFragments
from diloco.site.outer_sync import OuterSync, PendingRound
from diloco.site.overlap import InFlight
from diloco.sync import SyncMode, SyncSchedule


@dataclass
class LoopStats:
    step_s: list[float] = field(default_factory=list)  # wall time of every inner step
    stall_s: float = 0.0  # waiting on outer syncs: blocking syncs whole, overlapped ones when not landed in time
    stalls: int = 0  # overlapped rounds that had not landed when their merge was due
    started: float = 0.0  # monotonic: the loop's start (after joining)
    ended: float = 0.0  # monotonic: the last round landed (before what follows it: the final evaluation, logs)
    trained: float = 0.0  # monotonic: the last inner step of the run ended (before the final syncs)

    @property
    def compute_utilization(self) -> float | None:
        """Time in inner steps over the loop's wall time."""
        span = self.ended - self.started
        return sum(self.step_s) / span if span > 0 else None

    @property
    def utilization_until_last_step(self) -> float | None:
        """The same up to the end of the last inner step: without the run's final syncs, which no
        training can overlap (the tail a longer run spreads thinner)."""
        span = self.trained - self.started
        return sum(self.step_s) / span if span > 0 else None


class RoundLoop:
    """Runs rounds from the site's open round to the run's last.

    ``step(round, step)`` runs one inner step and returns its loss; ``tokens_per_step`` is the
    averaging weight of a step; ``on_round(pending, digest)`` is called with every round that
    landed; ``mean`` averages a loss over the site's ranks. The schedule's ``sync.budget_s``
    ends an inner phase early (dynamic local steps)."""

    def __init__(
        self,
        sync: OuterSync,
        schedule: SyncSchedule,
        step: Callable[[int, int], float],
        tokens_per_step: int,
        on_round: Callable[[PendingRound, str], None] = lambda _p, _d: None,
        *,
        mean: Callable[[float], float] = lambda x: x,
    ) -> None:
        self.sync, self.schedule = sync, schedule
        self._step, self._tokens_per_step, self._on_round, self._mean = step, tokens_per_step, on_round, mean
        self._budget_s = schedule.sync.budget_s
        # Overlapped rounds, and streaming's flush rounds (F > 1): up to F in flight at the run's end.
        flushes = schedule.train_rounds is not None and schedule.fragments > 1
        self.inflight = InFlight(sync, lanes=schedule.fragments if flushes else 1) if schedule.overlapped or flushes else None
        self.stats = LoopStats()
        # Steps of the phase being trained, or of the one just trained until its push: what
        # the site has trained beyond the rounds before it (site.py sets its lr schedule from it).
        self.phase_steps = 0
        self.steps_per_round: dict[int, int] = {}  # inner steps per round pushed (fewer than H/F under sync.budget_s)
        self.last_loss: dict[int, float] = {}  # the last inner loss of each round's phase
        self.frozen = FrozenFragments(sync.layout)  # sync.end=freeze: fragments past their last push

    def run(self) -> None:
        sync, inflight = self.sync, self.inflight
        self.stats.started = time.monotonic()
        for r in range(self._next_push()):  # a site joining late: the fragments already past their last push
            if self.schedule.frozen_after(r):
                self.frozen.freeze(sync.names_of(r))
        try:
            while self._next_push() < sync.total_rounds:
                if inflight is not None and self.schedule.flushes(self._next_push()):
                    self._flush()
                    break
                losses = self._phase()
                if inflight is not None and inflight.busy:
                    self._land()  # delayed/eager: the round pushed a phase ago lands before this phase's push
                if sync.finished:
                    break  # caught up past the last round: this phase's work has nowhere to go
                self.steps_per_round[sync.round] = len(losses)
                loss = self._mean(sum(losses) / len(losses)) if losses else math.nan
                pending = sync.begin(tokens=max(1, len(losses) * self._tokens_per_step), train_loss=loss, inner_steps=len(losses))
                self.phase_steps = 0  # its steps are in the round pushed now
                if self.schedule.frozen_after(pending.header.round):
                    self.frozen.freeze(pending.names)
                if inflight is None or not self.schedule.overlapped:
                    t = time.perf_counter()
                    digest = sync.finish(sync.exchange(pending))
                    self.frozen.refresh()
                    self.stats.stall_s += time.perf_counter() - t
                    self.stats.ended = time.monotonic()
                    self._on_round(pending, digest)
                    continue
                inflight.launch(pending)
                if self.schedule.sync.mode != SyncMode.BLOCKING:
                    sync.restart_phase(pending)
            while inflight is not None and inflight.busy:
                self._land()
        finally:
            if inflight is not None:
                inflight.close()
                self.stats.stall_s += inflight.stall_s
                self.stats.stalls = inflight.stalls
        self.stats.ended = self.stats.ended or time.monotonic()
        if self.schedule.sync.mode != SyncMode.BLOCKING:
            sync.load_global()  # the last phase started from its own start point; the run ends at θ

    def _next_push(self) -> int:
        """The round this site pushes next: the open one, or the one after the rounds in flight."""
        return self.sync.round + (self.inflight.count if self.inflight is not None else 0)

    def _flush(self) -> None:
        """Streaming's flush rounds, which no training is left to hide: each is pushed as soon
        as the round before it is committed, while that round's update is still being pulled
        (a link carries both ways at once), instead of one whole exchange after another; they
        land in order after the last. Their fragments are none of those in flight, so their Δ
        does not wait for those updates. The waits count as stalls."""
        sync, inflight = self.sync, self.inflight
        assert inflight is not None
        t = time.perf_counter()
        for r in range(self._next_push(), sync.total_rounds):
            if inflight.busy:
                inflight.committed()
            self.steps_per_round[r] = 0
            inflight.launch(sync.begin(tokens=1, train_loss=math.nan, inner_steps=0, round=r))  # 1 token: the sites' Δs count equally
        self.stats.stall_s += time.perf_counter() - t

    def _land(self) -> None:
        assert self.inflight is not None
        pending = self.inflight.land()
        digest = self.sync.finish(pending)
        self.frozen.refresh()
        self.stats.ended = time.monotonic()
        self._on_round(pending, digest)

    def _phase(self) -> list[float]:
        """Up to H/F inner steps (fewer under sync.budget_s); with overlap, the round in flight is
        merged after τ of them."""
        # The round this phase's steps go to (with a round in flight, the one after it).
        round, land_after = self._next_push(), self.schedule.land_after
        steps = self.schedule.steps_of(round)
        losses: list[float] = []
        phase_start = time.monotonic()
        self.phase_steps = 0
        for step in range(steps):
            t0 = time.monotonic()
            losses.append(self._step(round, step))
            self.stats.trained = time.monotonic()
            self.stats.step_s.append(self.stats.trained - t0)
            self.frozen.hold()  # not counted as training: it is the freeze's cost
            self.phase_steps = step + 1
            if self.inflight is not None and self.inflight.busy and land_after is not None and step + 1 == land_after:
                self._land()
            if self._budget_s is not None and time.monotonic() - phase_start >= self._budget_s:
                break
        if losses:
            self.last_loss[round] = losses[-1]
        return losses
