"""When a site syncs, and what it does meanwhile: the schedule of pushes and merges, and the
round in flight on a background thread.

Four ways to sync (``SyncSchedule``), all over the same coordinator rounds:

* blocking (DiLoCo): every H steps the site pushes Δ, waits for the round and loads θ.
* streaming (``fragments`` F > 1 and/or ``overlap_steps`` τ > 0, arXiv 2501.18512): a round
  every H/F steps, each syncing one fragment; the site pushes and trains τ more steps while
  the round is in flight, then merges the landed fragment (α·local + (1−α)·θ). τ < H/F, so
  one round is in flight at a time.
* delayed / eager (arXiv 2502.12996): the whole sync overlaps the next inner phase; that phase
  starts from θ as known (delayed: one round old) or from θ moved by the site's own fresh Δ
  (eager); the round lands at the end of that phase, before the next push.

The inner loop blocks on the network only when a merge is due and its round has not landed
(``InFlight.land``), and counts that time as a stall.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from diloco.site.outer_sync import OuterSync, PendingRound

OUTER_MODES = ("blocking", "eager", "delayed")
FRAGMENT_ENDS = ("flush", "freeze")


@dataclass(frozen=True)
class SyncSchedule:
    sync_every: int  # H
    fragments: int = 1  # F
    overlap_steps: int = 0  # τ
    outer_mode: str = "blocking"
    # Rounds with inner steps (R × F); with fragments, the F − 1 rounds after them are flush
    # rounds with none: fragments 0 .. F−2 push what they trained since their last sync, so
    # the run's θ holds every step. None: every round trains.
    train_rounds: int | None = None
    # The H of the first rounds (sync_every_schedule), growing to H: round r < len trains
    # early[r] steps, later rounds H. Blocking DiLoCo only (F = 1, τ = 0); ends at H.
    early: tuple[int, ...] = ()
    # How a streaming run ends (F > 1): "flush", the F − 1 flush rounds above; "freeze", each
    # fragment stops training at its last push (the other fragments train on around it), so no
    # flush round is needed and only the last round's sync is left after the last step.
    end: str = "flush"

    def problem(self) -> str | None:
        """What cannot work, naming the field; None when the schedule is sound."""
        for name in ("sync_every", "fragments"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                return f"{name}={v!r}: must be an integer >= 1"
        if self.outer_mode not in OUTER_MODES:
            return f"outer_mode={self.outer_mode!r}: must be one of {', '.join(OUTER_MODES)}"
        if self.sync_every % self.fragments:
            return f"sync_every={self.sync_every} is not divisible by fragments={self.fragments}: a fragment syncs every H/F steps"
        tau = self.overlap_steps
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            return f"overlap_steps={tau!r}: must be an integer >= 0"
        if tau >= self.round_steps:
            return f"overlap_steps={tau}: must be below sync_every/fragments = {self.round_steps} (one round in flight at a time)"
        if self.outer_mode != "blocking" and (self.fragments > 1 or tau > 0):
            return f"outer_mode={self.outer_mode} overlaps the whole sync with the next inner phase; it cannot be combined with fragments={self.fragments} or overlap_steps={tau} (use outer_mode=blocking for streaming)"
        if self.end not in FRAGMENT_ENDS:
            return f"fragment_end={self.end!r}: must be one of {', '.join(FRAGMENT_ENDS)}"
        if self.end == "freeze" and self.fragments == 1:
            return "fragment_end=freeze stops each fragment at its last push: it needs fragments > 1 (this run has fragments=1)"
        return self._early_problem()

    def _early_problem(self) -> str | None:
        early = list(self.early)
        if not early:
            return None
        if any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in early):
            return f"sync_every_schedule={early}: every entry must be an integer >= 1 (inner steps of a round)"
        if early[-1] != self.sync_every:
            return f"sync_every_schedule={early}: must end at sync_every={self.sync_every} (the H the run goes on with)"
        if self.fragments > 1 or self.overlap_steps > 0 or self.outer_mode != "blocking":
            return (
                f"sync_every_schedule cannot be combined with fragments={self.fragments}, overlap_steps={self.overlap_steps} or "
                f"outer_mode={self.outer_mode}: it is for blocking DiLoCo (fragments=1, overlap_steps=0, outer_mode=blocking)"
            )
        return None

    @property
    def round_steps(self) -> int:
        """Inner steps between two pushes (a coordinator round): H/F."""
        return self.sync_every // self.fragments

    def steps_of(self, round: int) -> int:
        """Inner steps before round ``round``'s push: H/F (the schedule's H in its first
        rounds), or 0 for a flush round."""
        if round < len(self.early):
            return self.early[round]
        return self.round_steps if self.train_rounds is None or round < self.train_rounds else 0

    def flushes(self, round: int) -> bool:
        """Round ``round`` is a flush round (no inner steps before its push)."""
        return self.train_rounds is not None and round >= self.train_rounds

    def steps_before(self, round: int) -> int:
        """Inner steps of rounds 0 .. ``round`` − 1: where round ``round`` starts in the lr
        schedule and the data."""
        n = min(round, len(self.early))
        trained = round if self.train_rounds is None else min(round, self.train_rounds)
        return sum(self.early[:n]) + max(0, trained - n) * self.round_steps

    def total_rounds(self, rounds: int) -> int:
        """The coordinator's rounds for ``rounds`` rounds of H steps: R × F, plus F − 1 flush
        rounds unless the fragments freeze."""
        return rounds * self.fragments + (0 if self.end == "freeze" else self.fragments - 1)

    def frozen_after(self, round: int) -> bool:
        """Under ``end=freeze``, round ``round`` is its fragment's last: the fragment stops
        training once it is pushed."""
        return self.end == "freeze" and self.train_rounds is not None and self.train_rounds - self.fragments <= round < self.train_rounds

    @property
    def overlapped(self) -> bool:
        """The site pushes without waiting for the round."""
        return self.overlap_steps > 0 or self.outer_mode != "blocking"

    @property
    def mode(self) -> str:
        if self.outer_mode != "blocking":
            return self.outer_mode
        return "streaming" if self.fragments > 1 or self.overlap_steps > 0 else "blocking"

    @property
    def land_after(self) -> int | None:
        """Steps after a push at which its round is merged (streaming: τ); None: at the end of
        the next inner phase, before its push (delayed, eager)."""
        return self.overlap_steps if self.outer_mode == "blocking" else None


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
