"""What sites pull from the coordinator, as calls: the wait for a round's commit, a committed
round's update, θ whole (with the outer momentum a look-ahead site follows) and the start
barrier a fresh run's first pulls of θ₀ wait at. ``Pulls`` sequences the parts on the
coordinator's lock: the round book (which rounds are servable), the sessions (members, the
barrier), the shard (θ, the momentum) and the downlink (what pullers get)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from diloco.boxes import Box
from diloco.codec import get_codec
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.downlink import Downlink
from diloco.coordinator.gate import Gate
from diloco.coordinator.round_book import RoundBook
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shards import ShardSet
from diloco.errors import CoordinatorError
from diloco.types import Chunk, RoundStatus
from diloco.wire import encode_chunks

START_HOLD_S = 20.0  # the longest a first pull of θ is held at the start barrier; then: pull again
GAVE_UP_POLL_S = 0.25  # how often a held wait looks whether its caller went away


class Pulls:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        gate: Gate,
        sessions: Sessions,
        book: RoundBook,
        shard: ShardSet,
        downlink: Callable[[], Downlink],
        *,
        clock: Callable[[], float],
        status: Callable[[], RoundStatus],
    ) -> None:
        """``downlink``: the coordinator's current one (θ₀ from a site replaces it); ``status``:
        the round status (under the lock)."""
        self.cfg, self.gate, self.sessions, self.book, self.shard = cfg, gate, sessions, book, shard
        self._downlink, self._clock, self._status = downlink, clock, status

    def wait_round(self, site_id: str, round: int, timeout_s: float, gave_up: threading.Event | None = None) -> RoundStatus:
        """Blocks until ``round`` is committed, ``timeout_s`` passes or ``gave_up`` is set (the
        caller went away: its call was cancelled); returns the status."""
        self._in_run(round)
        with self.gate.cv:
            self.gate.member(site_id)
            self.gate.ready()
            self._wait_commit(round, timeout_s, gave_up)
            self.gate.healthy()
            return self._status()

    def pull_update(
        self, site_id: str, round: int, want: Mapping[str, Box] | None = None, wait_s: float = 0.0, gave_up: threading.Event | None = None, early: bool = False
    ) -> list[Chunk] | None:
        """The encoded update of committed round ``round``; with ``want`` (name -> slice), only
        the chunks that hold rows of those slices (what one rank of a sharded site needs). With
        ``wait_s`` > 0 it first waits that long for the round's commit, or until ``gave_up`` is
        set, and returns None if the round is still open then (``wait_round`` and the pull in
        one call). ``early`` (with ``wait_s``): the update as soon as it is computed, while its
        checkpoint is still being written; the caller must not hand it on before
        ``wait_durable(round)`` has returned (the gRPC server ends the stream only then). A
        round outside the run is refused (out_of_range) whether or not the call waits."""
        self._in_run(round)
        with self.gate.cv:
            self.gate.member(site_id)
            self.gate.ready()
            self._downlink().check_want(want)
            early = early and wait_s > 0
            if wait_s > 0:
                self._wait_commit(round, wait_s, gave_up, early)
                self.gate.healthy()
                if not self._servable(round, early):
                    return None
                self.gate.member(site_id)  # it may have been dropped while it waited
            if not self._servable(round, early):
                raise CoordinatorError("failed_precondition", f"round {round} is not committed yet (committed rounds: {self.book.open})")
            return self._downlink().update(round, want)

    def wait_durable(self, round: int, gave_up: threading.Event | None = None) -> bool:
        """Blocks until round ``round``'s commit is durable (its checkpoint written): True; False
        if ``gave_up`` was set first. Raises unavailable if the coordinator failed (its
        checkpoint could not be written: the round never happened)."""
        with self.gate.cv:
            while self.book.open <= round and self.gate.failed is None:
                if gave_up is not None and gave_up.is_set():
                    return False
                self.gate.cv.wait(GAVE_UP_POLL_S)
            self.gate.healthy()
            return True

    def _in_run(self, round: int) -> None:
        """Refuses (out_of_range) a round that is not one of this run's."""
        if not 0 <= round < self.cfg.total_rounds:
            raise CoordinatorError("out_of_range", f"round {round}: this run's rounds are 0..{self.cfg.total_rounds - 1}")

    def _servable(self, round: int, early: bool) -> bool:
        return self.book.servable(round, early)

    def _wait_commit(self, round: int, timeout_s: float, gave_up: threading.Event | None, early: bool = False) -> None:
        """Waits (holding ``_cv``) until ``round`` commits (``early``: until its update is
        computed), the run fails, ``timeout_s`` passes or ``gave_up`` is set. A commit wakes
        the wait at once; ``gave_up`` is looked at every ``GAVE_UP_POLL_S``, so that a
        cancelled call's thread is free within that."""
        done = lambda: self._servable(round, early) or self.gate.failed is not None  # noqa: E731
        if gave_up is None:
            self.gate.cv.wait_for(done, timeout=max(0.0, timeout_s))
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not done() and not gave_up.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.gate.cv.wait(min(left, GAVE_UP_POLL_S))

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk]]:
        """θ after the last committed round, float32, with the round status it belongs to (with
        ``want``: only the chunks that hold rows of those slices)."""
        status, chunks, _ = self._pull_global(site_id, want, outer_state=False)
        return status, chunks

    def pull_global_with_state(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk], list[Chunk]]:
        """``pull_global``'s θ and, of the same round, the outer optimizer's momentum buffers
        (float32, zeros where it keeps none yet; none at all before the first round commits):
        what a site that looks ahead of the outer step (eager, merge=ahead) follows. An outer
        step it cannot follow (not SGD) is refused with failed_precondition."""
        return self._pull_global(site_id, want, outer_state=True)

    def _pull_global(self, site_id: str, want: Mapping[str, Box] | None, outer_state: bool) -> tuple[RoundStatus, list[Chunk], list[Chunk]]:
        with self.gate.cv:
            self.gate.member(site_id)
            self.gate.ready()
            self._downlink().check_want(want)
            outer = self.shard.outer
            assert outer is not None
            if outer_state and outer.cfg.name != "SGD":
                raise CoordinatorError("failed_precondition", f"the outer step is {outer.cfg.name}, not SGD: it keeps no momentum buffer a look-ahead follows")
            self._await_start(site_id)
            self.gate.published()
            open_round = self.book.open

            def encode(tensors: Callable[[], Mapping[str, torch.Tensor]]) -> Callable[[Sequence[str] | None], list[Chunk]]:
                def chunks(names: Sequence[str] | None) -> list[Chunk]:
                    every = tensors()
                    some = every if names is None else {n: every[n] for n in names}
                    return list(encode_chunks(some, codec=get_codec("fp32"), chunk_bytes=self.cfg.chunk_bytes))

                return chunks

            chunks = self._downlink().global_params(open_round, encode(lambda: outer.params), want)
            # Before the first outer step there is no momentum to follow: none is sent.
            momentum = self._downlink().outer_state(open_round, encode(outer.momentum_buffers), want) if outer_state and open_round > 0 else []
            return self._status(), chunks, momentum

    def _await_start(self, site_id: str) -> None:
        """Under the lock: a fresh run's first pulls of θ wait at the start barrier
        (diloco.coordinator.start_barrier), each call ``START_HOLD_S`` at most; the one that
        opens it opens round 0 then, for every site at once."""
        barrier = self.sessions.barrier
        if barrier.open:
            return
        if self.book.open > 0:
            barrier.open = True
            return
        now = self._clock()
        barrier.arrive(site_id, now)
        give_up = now + START_HOLD_S
        while not barrier.open:
            if barrier.release(now):
                if not self.book.current.pushed_at:
                    self.book.current.opened_at = now
                self.gate.cv.notify_all()
                break
            if now >= give_up:
                raise CoordinatorError("unavailable", f"the run starts when every site has pulled θ₀: {barrier.waiting_for()}; pull again shortly")
            self.gate.cv.wait(timeout=max(0.0, min(0.5, give_up - now, barrier.opens_at - now)))
            self.gate.healthy()
            with contextlib.suppress(KeyError):  # waiting here is a sign of life
                self.sessions.members.renew(site_id)
            now = self._clock()
