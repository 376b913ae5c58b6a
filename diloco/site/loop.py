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

from diloco.site.outer_sync import OuterSync, PendingRound
from diloco.site.overlap import InFlight, SyncSchedule


@dataclass
class LoopStats:
    step_s: list[float] = field(default_factory=list)  # wall time of every inner step
    stall_s: float = 0.0  # waiting on outer syncs: blocking syncs whole, overlapped ones when not landed in time
    stalls: int = 0  # overlapped rounds that had not landed when their merge was due
    started: float = 0.0  # monotonic: the loop's start (after joining)
    ended: float = 0.0  # monotonic: the last round landed
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
    landed; ``mean`` averages a loss over the site's ranks; ``budget_s`` ends an inner phase
    early (dynamic local steps)."""

    def __init__(
        self,
        sync: OuterSync,
        schedule: SyncSchedule,
        step: Callable[[int, int], float],
        tokens_per_step: int,
        on_round: Callable[[PendingRound, str], None] = lambda _p, _d: None,
        *,
        mean: Callable[[float], float] = lambda x: x,
        budget_s: float | None = None,
    ) -> None:
        self.sync, self.schedule = sync, schedule
        self._step, self._tokens_per_step, self._on_round, self._mean, self._budget_s = step, tokens_per_step, on_round, mean, budget_s
        self.inflight = InFlight(sync) if schedule.overlapped else None
        self.stats = LoopStats()
        # Steps of the phase being trained, or of the one just trained until its push: what
        # the site has trained beyond the rounds before it (site.py sets its lr schedule from it).
        self.phase_steps = 0
        self.steps_per_round: dict[int, int] = {}  # inner steps per round pushed (fewer than H/F under budget_s)
        self.last_loss: dict[int, float] = {}  # the last inner loss of each round's phase

    def run(self) -> None:
        sync, inflight = self.sync, self.inflight
        self.stats.started = time.monotonic()
        try:
            while self._next_push() < sync.total_rounds:
                losses = self._phase()
                if inflight is not None and inflight.busy:
                    self._land()  # delayed/eager: the round pushed a phase ago lands before this phase's push
                if sync.finished:
                    break  # caught up past the last round: this phase's work has nowhere to go
                self.steps_per_round[sync.round] = len(losses)
                # A flush round (no steps) weighs 1 token per site: the sites' Δs count equally.
                loss = self._mean(sum(losses) / len(losses)) if losses else math.nan
                pending = sync.begin(tokens=max(1, len(losses) * self._tokens_per_step), train_loss=loss, inner_steps=len(losses))
                self.phase_steps = 0  # its steps are in the round pushed now
                if inflight is None:
                    t = time.perf_counter()
                    digest = sync.finish(sync.exchange(pending))
                    self.stats.stall_s += time.perf_counter() - t
                    self._on_round(pending, digest)
                    continue
                inflight.launch(pending)
                if self.schedule.outer_mode != "blocking":
                    sync.restart_phase(pending)
            if inflight is not None and inflight.busy:
                self._land()
        finally:
            if inflight is not None:
                inflight.close()
                self.stats.stall_s += inflight.stall_s
                self.stats.stalls = inflight.stalls
        self.stats.ended = time.monotonic()
        if self.schedule.outer_mode != "blocking":
            sync.load_global()  # the last phase started from its own start point; the run ends at θ

    def _next_push(self) -> int:
        """The round this site pushes next: the open one, or the one after the round in flight."""
        return self.sync.round + (1 if self.inflight is not None and self.inflight.busy else 0)

    def _land(self) -> None:
        assert self.inflight is not None
        pending = self.inflight.land()
        self._on_round(pending, self.sync.finish(pending))

    def _phase(self) -> list[float]:
        """Up to H/F inner steps (fewer under budget_s); with overlap, the round in flight is
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
            self.phase_steps = step + 1
            if self.inflight is not None and self.inflight.busy and land_after is not None and step + 1 == land_after:
                self._land()
            if self._budget_s is not None and time.monotonic() - phase_start >= self._budget_s:
                break
        if losses:
            self.last_loss[round] = losses[-1]
        return losses
