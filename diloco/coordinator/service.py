"""The coordinator: a façade over parts that each own their state, sequenced on one lock.

Control plane (who is in the run, which round, which sites a round counts): the sessions
(sessions.py: members and their leases, who left, the θ₀ election, the start barrier, the
sites' evaluations) and the round book (round_book.py: the open round and its phase, the
facts of its pushes, the committed rounds' participants and records). Data plane (receive,
sum, outer step, downlink for the parameters it owns): the intake (intake.py: staging,
sharded pushes' parts, the norm bound), the shard (shard.py: θ, the outer optimizer, the
open round's sum, the update's encoding) and the downlink (downlink.py: what pullers get).
The calls sequence them: joins.py, pushes.py, pulls.py; the gate (gate.py) holds the checks
every call passes and the coordinator's health. This module builds the parts, commits and
publishes rounds, writes and restores checkpoints, and answers the read-only questions.

Threading: every public method may be called from any gRPC worker thread. One condition
variable guards the state; decoding a push happens outside it (in a staging buffer from a
bounded pool), so memory is O(params × max_concurrent_pushes), never O(sites × params), and
a push that fails half-way leaves the round untouched. A commit is computed under the lock
but published (the round number moves on, waiters wake) only after its checkpoint is on
disk, and the checkpoint is written without the lock: pushes, heartbeats and joins go on
meanwhile; pushes for the closing round and pulls of θ wait for the publication.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.boxes import Box
from diloco.checkpoint import save_checkpoint
from diloco.coordinator.commit import Closing, RoundRecord
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.downlink import Downlink
from diloco.coordinator.gate import Gate
from diloco.coordinator.intake import Intake
from diloco.coordinator.joins import Joins
from diloco.coordinator.pulls import Pulls
from diloco.coordinator.pushes import Pushes
from diloco.coordinator.round_book import KEEP_RECORDS, Phase, RoundBook
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shards import ShardSet
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, params_sha256
from diloco.outer.pseudo_gradient import params_sha256_v1
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec


@dataclass
class _Commit:
    """A commit computed under the lock, to be made durable and then published."""

    record: RoundRecord
    update: list[Chunk]
    checkpoint: dict[str, Any] | None
    closed_at: float  # the coordinator's clock at the commit: the next round opens then
    times: dict[str, Any]  # seconds of the commit's parts (Coordinator.commit_timings)


class Coordinator:
    """Holds θ and the outer optimizer; runs rounds 0 .. total_rounds-1."""

    def __init__(
        self, params: Mapping[str, torch.Tensor] | None, outer: OuterConfig, cfg: CoordinatorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``params``: θ₀; None (init=site): the first site that joins and can upload sends it."""
        self.cfg = cfg
        self._policy = cfg.policy
        self._clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self.on_init: list[Callable[[str], None]] = []  # called with who sent θ₀ (init=site)
        self.on_commit: list[Callable[[RoundRecord], None]] = []
        self.on_push: list[Callable[[int], None]] = []  # called with the round after each accepted push
        # Called with what failed and the exception when a commit cannot be made durable or
        # the ticker breaks: the coordinator then refuses every call (unavailable) and its
        # process should exit non-zero, so that a supervisor restarts it from its checkpoint.
        self.on_fatal: list[Callable[[str, BaseException], None]] = []
        self._cv = threading.Condition()
        # control plane
        self.sessions = Sessions(cfg, clock)
        self.book = RoundBook(cfg.total_rounds, clock(), cfg.quorum.withheld)
        # data plane
        self.shard = ShardSet(outer, cfg)  # the data plane, cut into coordinator.shards ranges
        self.intake = Intake(cfg)
        self._downlink = Downlink({}, cfg.keep_updates, cfg.bundle_bytes)  # what pullers get
        # the calls
        self.gate = Gate(self._cv, self.sessions, self.book, self.shard)
        self.joins = Joins(
            cfg, self.gate, self.sessions, self.shard, self.intake, self.book, run_id=lambda: self.run_id, install=self._install_from_site, status=self._status,
            on_init=self.on_init,
        )  # fmt: skip
        self.pushes = Pushes(
            cfg,
            self.gate,
            self.sessions,
            self.book,
            self.shard,
            self.intake,
            clock=clock,
            close=self._maybe_commit,
            publish=self._publish,
            on_push=self.on_push,
        )
        self.pulls = Pulls(cfg, self.gate, self.sessions, self.book, self.shard, lambda: self._downlink, clock=clock, status=self._status)
        if params is not None:
            self._install(params, cfg.init_source)

    def _install(self, params: Mapping[str, torch.Tensor], source: str) -> None:
        """θ₀ and everything sized by it: the shard, the downlink, the open round."""
        self.shard.install(params, source)
        self._downlink = Downlink(self.shard.specs, self.cfg.keep_updates, self.cfg.bundle_bytes)
        self._reopen(self.book.open, self._clock())

    def _install_from_site(self, params: Mapping[str, torch.Tensor], source: str) -> None:
        """Under the lock: θ₀ as a site sent it (init=site), durable before any site can pull it."""
        self._install(params, source)
        if self.cfg.checkpoint_dir is not None:
            save_checkpoint(Path(self.cfg.checkpoint_dir), 0, self._checkpoint_state())

    def _reopen(self, number: int, opened_at: float) -> None:
        names, fragment = self.shard.open(number)
        self.book.reopen(number, opened_at, names, fragment)

    # ---- the calls (diloco.transport.protocol.CoordinatorService) -------------------------
    def join(self, request: JoinRequest) -> JoinInfo:
        return self.joins.join(request)

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        return self.joins.upload_init(header, chunks)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        self.joins.leave(site_id, global_sha256, eval)

    def heartbeat(self, site_id: str) -> RoundStatus:
        return self.joins.heartbeat(site_id)

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        return self.pushes.push(header, chunks)

    def wait_round(self, site_id: str, round: int, timeout_s: float, gave_up: threading.Event | None = None) -> RoundStatus:
        return self.pulls.wait_round(site_id, round, timeout_s, gave_up)

    def pull_update(
        self, site_id: str, round: int, want: Mapping[str, Box] | None = None, wait_s: float = 0.0, gave_up: threading.Event | None = None, early: bool = False
    ) -> list[Chunk] | None:
        return self.pulls.pull_update(site_id, round, want, wait_s, gave_up, early)

    def wait_durable(self, round: int, gave_up: threading.Event | None = None) -> bool:
        return self.pulls.wait_durable(round, gave_up)

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk]]:
        return self.pulls.pull_global(site_id, want)

    def pull_global_with_state(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk], list[Chunk]]:
        return self.pulls.pull_global_with_state(site_id, want)

    # ---- read-only views -------------------------------------------------------------
    @property
    def failed(self) -> str | None:
        return self.gate.failed

    @property
    def fragments(self) -> tuple[tuple[str, ...], ...]:
        """The split of the parameters into fragments (one fragment, every name, by default)."""
        with self._cv:
            return self.shard.split

    @property
    def init_from(self) -> str:
        return self.shard.init_from

    @property
    def specs(self) -> dict[str, TensorSpec]:
        with self._cv:
            return dict(self.shard.specs)

    @property
    def ready(self) -> bool:
        """θ₀ is set (always, unless init=site and no site has sent it yet)."""
        with self._cv:
            return self.shard.ready

    def wait_ready(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.shard.ready, timeout=timeout_s)

    def shard_sizes(self) -> list[int]:
        """Parameters in each of the data plane's ranges (coordinator.shards; one before θ₀)."""
        with self._cv:
            return [sum(math.prod(s.shape) for s in part.specs.values()) for part in self.shard.parts]

    @property
    def committed_rounds(self) -> int:
        with self._cv:
            return self.book.open

    @property
    def finished(self) -> bool:
        with self._cv:
            return self.book.finished

    def global_sha256(self) -> str:
        with self._cv:
            return self.shard.hash

    def global_params(self) -> dict[str, torch.Tensor]:
        with self._cv:
            self.gate.published()
            outer = self.shard.outer
            return {n: p.clone() for n, p in outer.params.items()} if outer is not None else {}

    def bytes_down(self, round: int) -> int:
        with self._cv:
            return self._downlink.bytes_sent(round)

    def left_sites(self) -> dict[str, str]:
        with self._cv:
            return dict(self.sessions.left)

    def status(self) -> RoundStatus:
        with self._cv:
            return self._status()

    def _status(self) -> RoundStatus:
        return RoundStatus(committed_rounds=self.book.open, total_rounds=self.cfg.total_rounds, global_sha256=self.shard.hash)

    @property
    def active_sites(self) -> frozenset[str]:
        with self._cv:
            return self.sessions.members.active

    def site_counts(self) -> dict[str, int]:
        """Sites by membership state: active, evicted, left."""
        with self._cv:
            return self.sessions.members.counts()

    def site_states(self) -> dict[str, dict[str, Any]]:
        """Site -> {"state": active | evicted | left, "joins", "pushed_s_ago"}: a copy taken under
        the lock at once (the status page's view; diloco/observe/status_state.py)."""
        with self._cv:
            return self.sessions.states(self._clock(), self.book.current.pushed_at)

    def site_eval(self, round: int) -> dict[str, Any] | None:
        """The sites' evaluation of θ after ``round`` (SiteEvals.mean)."""
        with self._cv:
            return self.sessions.evals.mean(round)

    def commit_timings(self) -> list[dict[str, Any]]:
        """The recent commits' parts, in seconds, oldest first: ``round``, ``closer`` (the site
        whose push closed it; None for a round the ticker closed), ``receive_s`` (the closing
        push's receive and decode, of which ``first_chunk_s`` until its first chunk, from
        ``began_at``), ``lock_s``, ``commit_s`` (the commit under the lock: its
        ``mean_s``, ``step_s`` with ``encode_s``, ``record_s``), ``serve_s`` (the update
        bundled and handed to the held pulls), ``checkpoint_s`` (made durable, without the lock,
        while the pulls stream), ``publish_s`` and ``published_at`` (``began_at`` and
        ``published_at`` read time.monotonic, the others time.perf_counter)."""
        with self._cv:
            return [dict(t) for t in self.book.timings]

    def refusals(self) -> dict[str, int]:
        """Site -> how many of its pushes the norm bound refused over the run."""
        with self._cv:
            return dict(sorted(self.intake.refusals.items()))

    def late_pushes(self, round: int) -> list[dict[str, Any]]:
        """Pushes ({"site", "round"}) that arrived while ``round`` was open, for rounds committed
        without them; for the last round, also those that arrived after it was committed."""
        with self._cv:
            return self.book.late_pushes(round)

    def recent_records(self) -> dict[int, dict[str, Any]]:
        """RoundRecord.summary() of the last few committed rounds (restored from a checkpoint
        too: a restarted coordinator rewrites the metrics lines its predecessor had not)."""
        with self._cv:
            return {r: dict(rec) for r, rec in self.book.records.items()}

    def round_settled(self, round: int) -> bool:
        """True once no more pulls of ``round``'s update are expected: the next round is
        committed (every participant has pulled it) or every site has left."""
        with self._cv:
            return self.book.open > round + 1 or (self.book.open > round and not self.sessions.members.active)

    def wait_all_left(self, timeout_s: float) -> bool:
        """After the last round: waits until every site has left, evicted ones too (a site cut
        off near the end comes back, joins again, pulls θ and leaves); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.book.finished and not self.sessions.members.not_left, timeout=timeout_s)

    # ---- time ------------------------------------------------------------------------
    def tick(self) -> RoundRecord | None:
        """Evicts sites whose lease ended and closes the round if the policy now allows it.
        Called periodically (``start_ticker``); returns the record of a commit."""
        with self._cv:
            # While a commit is being made durable, evictions wait for the next tick: they
            # belong to the round that opens when it is published.
            evicted = [] if self.book.phase != Phase.OPEN else self.sessions.members.expire()
            if evicted:
                self.book.current.evicted.extend(evicted)
                self._cv.notify_all()
            pending = self._maybe_commit()
        return self._publish(pending)

    def start_ticker(self, interval_s: float = 0.2) -> Callable[[], None]:
        """Runs ``tick`` every ``interval_s`` on a daemon thread; returns the function that stops it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.tick()
                except BaseException as e:  # noqa: BLE001 - a dead ticker must never go unnoticed
                    self._fail("the ticker", e)
                    return

        thread = threading.Thread(target=loop, name="coordinator-ticker", daemon=True)
        thread.start()

        def stop_ticker() -> None:
            stop.set()
            thread.join()

        return stop_ticker

    def _fail(self, what: str, e: BaseException) -> None:
        """Marks the coordinator failed (every call is refused from now on) and tells the
        ``on_fatal`` listeners; without listeners the exception propagates."""
        with self._cv:
            self.gate.fail(what, e)
        if not self.on_fatal:
            raise e
        for listener in self.on_fatal:
            listener(what, e)

    # ---- commits ---------------------------------------------------------------------
    def _maybe_commit(self, times: dict[str, Any] | None = None) -> _Commit | None:
        """Under the lock: closes the open round if the policy allows it. θ moves now; the
        round is published by ``_publish`` once its checkpoint is durable. ``times``: what the
        closing push measured so far (commit_timings)."""
        book = self.book
        if not self.shard.ready or book.phase != Phase.OPEN or book.finished:
            return None
        state = book.current
        if not self._policy.should_close(self._clock(), state.opened_at, state.pushed_at, self.sessions.members.active):
            return None
        r = state.number
        every = self.cfg.snapshot_every
        closing = Closing(
            active=self.sessions.members.active,
            now=self._clock(),
            started=book.started,
            snapshot=(every > 0 and (r + 1) % every == 0) or r + 1 == self.cfg.total_rounds,
        )
        times = {"round": r, "closer": None, **(times or {})}
        t0 = time.perf_counter()
        record, update = self.shard.commit(state, closing, times)
        times["commit_s"] = time.perf_counter() - t0
        book.closing(record)
        self.sessions.evals.prune(before=r - KEEP_RECORDS + 1)
        checkpoint = self._checkpoint_state(committed=r + 1, global_sha256=record.global_sha256) if self.cfg.checkpoint_dir is not None else None
        return _Commit(record, update, checkpoint, closing.now, times)

    def _publish(self, pending: _Commit | None) -> RoundRecord | None:
        """Without the lock: writes the commit's checkpoint (a restart never loses a round any
        site saw committed), then publishes it and tells the listeners."""
        if pending is None:
            return None
        record = pending.record
        t0 = time.perf_counter()
        # The update goes down while the checkpoint is written: pulls held for this round
        # stream it now and end once the round is durable (pulls.Pulls.wait_durable), so the
        # checkpoint's time overlaps the transfer instead of coming before it.
        served = self._downlink.prepare(pending.update)
        with self._cv:
            self._downlink.put_update(record.round, served)
            self.book.serving()
            self._cv.notify_all()
        t_served = time.perf_counter()
        if pending.checkpoint is not None:
            # If this raises, θ has moved but the round cannot be published durably: the
            # coordinator stays closing (it never takes the round's pushes twice) and its
            # process must be restarted from the last good checkpoint.
            try:
                save_checkpoint(Path(str(self.cfg.checkpoint_dir)), record.round + 1, pending.checkpoint)
            except Exception as e:
                self._fail(f"the checkpoint of round {record.round}", e)
                raise CoordinatorError("unavailable", f"round {record.round} could not be made durable; the coordinator must restart") from None
        t1 = time.perf_counter()
        with self._cv:
            self.shard.hash = record.global_sha256
            self.book.published(record.round, {**pending.times, "serve_s": t_served - t0, "checkpoint_s": t1 - t_served})
            # Parts of pushes for rounds that can no longer be taken (refused, or too late to merge).
            stale = self.cfg.quorum.max_staleness if self.cfg.quorum.late == "merge" else 0
            self.intake.parts.prune(lambda rnd: self.book.open - rnd <= stale)
            self._reopen(self.book.open, pending.closed_at)
            self._cv.notify_all()
            self.book.timings[-1].update(publish_s=time.perf_counter() - t1, published_at=time.monotonic())
        for listener in self.on_commit:
            listener(record)
        return record

    # ---- checkpoints -----------------------------------------------------------------
    def _checkpoint_state(self, committed: int | None = None, global_sha256: str | None = None) -> dict[str, Any]:
        """The state a checkpoint holds (by reference: no commit can move it before it is written)."""
        return {
            "run_id": self.run_id,
            "global_sha256": self.shard.hash if global_sha256 is None else global_sha256,
            **self.book.checkpoint(self.book.open if committed is None else committed),
            **self.shard.checkpoint(),
            **self.sessions.checkpoint(),
            **self.intake.checkpoint(),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resumes from a checkpoint's state: θ, the outer optimizer, the downlink residual, the
        round and the membership (active sites get a fresh lease). Refuses a state whose θ does
        not hash to the saved value, or one past this run's last round."""
        committed = int(state["committed_rounds"])
        if not 0 <= committed <= self.cfg.total_rounds:
            raise ValueError(f"checkpoint has {committed} committed rounds; this run has {self.cfg.total_rounds}")
        digest = params_sha256(state["outer"]["params"])  # checked before anything is loaded
        if digest != state["global_sha256"] and params_sha256_v1(state["outer"]["params"]) != state["global_sha256"]:  # v1: written before 2026-12-08
            raise ValueError(f"checkpoint θ hashes to {digest[:16]}, the checkpoint says {str(state['global_sha256'])[:16]}")
        with self._cv:
            if not self.shard.ready:  # init=site: θ₀ was committed before the restart; never asked again
                self._install(state["outer"]["params"], str(state.get("init_from", "the checkpoint")))
            self.shard.restore(state)
            self.run_id = str(state["run_id"])
            self.sessions.restore(state)
            self.intake.restore(state)
            self._downlink.clear()
            now = self._clock()
            self.book.restore(state, now)
            self._reopen(committed, now)
