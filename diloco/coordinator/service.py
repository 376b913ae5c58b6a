"""The coordinator: a façade over the round's parts. A site's session, its join, heartbeats
and leave (sessions.py, over membership.py; θ₀ from a site: init_source.py), the pushes' way
in (intake.py) and what to do with each (verdict.py), the open round (round_state.py), its
commit (commit.py), the pulls and waits (pulls.py) of what pullers get (downlink.py), and
checkpoints.

Threading: every public method may be called from any gRPC worker thread. One condition
variable guards the state; decoding a push happens outside it (in a staging buffer from a
bounded pool), so memory is O(params × max_concurrent_pushes), never O(sites × params), and
a push that fails half-way leaves the round untouched. A commit is computed under the lock
but published (the round number moves on, waiters wake) only after its checkpoint is on
disk, and the checkpoint is written without the lock: pushes, heartbeats and joins go on
meanwhile; pushes for the closing round and pulls of θ wait for the publication.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import save_checkpoint
from diloco.coordinator.commit import Closing, RoundRecord, UpdateEncoder, commit
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.downlink import Downlink
from diloco.coordinator.guard import SpikeGuard
from diloco.coordinator.headers import HeaderBounds
from diloco.coordinator.init_source import InitElection
from diloco.coordinator.intake import PushIntake
from diloco.coordinator.membership import Membership
from diloco.coordinator.parts import PartialPushes
from diloco.coordinator.pulls import Pulls
from diloco.coordinator.round_state import RoundState
from diloco.coordinator.sessions import SiteSessions
from diloco.coordinator.site_evals import SiteEvals
from diloco.coordinator.staging import StagingPool
from diloco.coordinator.start_barrier import StartBarrier
from diloco.errors import CoordinatorError
from diloco.outer import NormBound, OuterConfig, OuterOptimizer, averaged_from, params_sha256
from diloco.outer.fragments import fragment_of_round, split_fragments
from diloco.security.ids import quote, site_id_problem
from diloco.types import Chunk, RoundStatus, TensorSpec
from diloco.wire import fingerprint

_KEEP_RECORDS = 16
_KEEP_TIMINGS = 4096  # commit_timings: the last rounds' (a few hundred bytes each)
RESTART_GRACE_S = 10.0  # added to the restored members' first lease after a restart


@dataclass
class _Commit:
    """A commit computed under the lock, to be made durable and then published."""

    record: RoundRecord
    update: list[Chunk]
    checkpoint: dict[str, Any] | None
    closed_at: float  # the coordinator's clock at the commit: the next round opens then
    times: dict[str, Any]  # seconds of the commit's parts (Coordinator.commit_timings)


class Coordinator(PushIntake, SiteSessions, Pulls):
    """Holds θ and the outer optimizer; runs rounds 0 .. total_rounds-1."""

    def __init__(
        self, params: Mapping[str, torch.Tensor] | None, outer: OuterConfig, cfg: CoordinatorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``params``: θ₀; None (init=site): the first site that joins and can upload sends it."""
        self.cfg = cfg
        self._policy = cfg.policy
        self._clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self._outer_cfg = outer
        self._election = InitElection(cfg.quorum.lease_s, clock)
        self._site_evals = SiteEvals()  # evaluation by the sites
        self.on_init: list[Callable[[str], None]] = []  # called with who sent θ₀ (init=site)
        self.on_commit: list[Callable[[RoundRecord], None]] = []
        self.on_push: list[Callable[[int], None]] = []  # called with the round after each accepted push
        # Called with what failed and the exception when a commit cannot be made durable or
        # the ticker breaks: the coordinator then refuses every call (unavailable) and its
        # process should exit non-zero, so that a supervisor restarts it from its checkpoint.
        self.on_fatal: list[Callable[[str, BaseException], None]] = []
        self.failed: str | None = None
        self._bounds = HeaderBounds(total_rounds=cfg.total_rounds, max_tokens=cfg.max_tokens_per_push)
        self._cv = threading.Condition()
        self._members = Membership(cfg.quorum.lease_s, clock)
        self._left: dict[str, str] = {}  # site id -> the hash it reported when leaving
        self._open = 0  # the open round = the number of committed (published) rounds
        self._committing = False  # a commit is being made durable; not published yet
        # The round being made durable, whose update a held pull may already stream: the pull's
        # stream ends (and the site applies the update) only once the round is durable.
        self._streamed: int | None = None
        self._participants: dict[int, list[str]] = {}
        self._ready = False  # θ₀ is set
        self._specs: dict[str, TensorSpec] = {}
        self._downlink = Downlink(self._specs, cfg.keep_updates, cfg.bundle_bytes)  # what pullers get
        self._hash = ""
        self.init_from = "a site (init=site), not yet"  # who θ₀ came from, named in messages
        self._start = clock()
        self._split: tuple[tuple[str, ...], ...] = ((),)
        self._round = RoundState.open(0, self._start, {}, cfg.aggregate, cfg.robust.trim, withheld=cfg.quorum.withheld)
        if params is not None:
            self._install(params, cfg.init_source)
        self._staging = StagingPool(cfg.max_concurrent_pushes, cfg.staging_timeout_s)
        self._guard = SpikeGuard(cfg.guard)
        self._bound = NormBound(cfg.robust)  # robust.norm_ratio: each push's Δ norm against recent ones
        self._refusals: dict[str, int] = {}  # site -> its pushes refused by the bound, over the run
        # open round -> pushes refused while it was open, for rounds already closed without them
        self._late: dict[int, list[dict[str, Any]]] = {}
        self._records: dict[int, dict[str, Any]] = {}  # the last few rounds' RoundRecord.summary()
        self._merged_done: set[tuple[str, int]] = set()  # (site, round) of every merged push (repeats are duplicates)
        self._parts = PartialPushes()  # parts of sharded sites' pushes, until each site's last part
        # The seconds of each recent commit's parts (commit_timings): what the closing push costs.
        self._timings: collections.deque[dict[str, Any]] = collections.deque(maxlen=_KEEP_TIMINGS)
        expected = len(cfg.sites) if cfg.sites is not None else cfg.max_sites
        self._barrier = StartBarrier(expected, cfg.quorum.start_wait_s)  # round 0 starts when every site is in

    def _install(self, params: Mapping[str, torch.Tensor], source: str) -> None:
        """θ₀ and everything sized by it: the outer optimizer, the open round, the downlink."""
        average_from = averaged_from(
            self.cfg.total_rounds, self.cfg.flush_rounds, self._outer_cfg.final_average, last=self.cfg.fragments if self.cfg.frozen_end else 1
        )
        self._outer = OuterOptimizer(
            params, self._outer_cfg, steps=-(-self.cfg.total_rounds // self.cfg.fragments), fragments=self.cfg.fragments, average_from=average_from
        )
        self._specs = fingerprint(self._outer.params)
        self._shapes = {n: p.shape for n, p in self._outer.params.items()}
        self._encoder = UpdateEncoder.of(self.cfg.codec_down.build(), self._specs, self.cfg.chunk_bytes, self.cfg.error_feedback_down)
        self._downlink = Downlink(self._specs, self.cfg.keep_updates, self.cfg.bundle_bytes)
        self._split = split_fragments(self._shapes, self.cfg.fragments, self.cfg.fragment_split)  # ValueError: more fragments than layers
        self._round = self._open_round(self._open, self._clock())
        self._hash = params_sha256(self._outer.params)
        self.init_from = source
        self._ready = True

    # ---- fragments (streaming DiLoCo): round r syncs fragment r mod F -----------------------
    def _open_round(self, number: int, opened_at: float) -> RoundState:
        fragment = fragment_of_round(number, self.cfg.fragments)
        names = self._split[fragment] if len(self._split) > fragment else ()  # before θ₀ (init=site): none
        return RoundState.open(
            number, opened_at, {n: self._shapes[n] for n in names}, self.cfg.aggregate, self.cfg.robust.trim, fragment, self.cfg.quorum.withheld
        )

    def _round_specs(self, round: int) -> dict[str, TensorSpec]:
        """The tensors a push for ``round`` carries: every one, or its fragment's."""
        return {n: self._specs[n] for n in self._split[fragment_of_round(round, self.cfg.fragments)]}

    def _check_fragment(self, round: int, name: str) -> None:
        """A chunk of a tensor that round ``round``'s fragment does not hold is refused, saying
        which fragment it belongs to (an unknown name is left to the assembler to name)."""
        if self.cfg.fragments == 1:
            return
        fragment = fragment_of_round(round, self.cfg.fragments)
        if name in self._split[fragment]:
            return
        owner = next((i for i, part in enumerate(self._split) if name in part), None)
        if owner is not None:
            raise CoordinatorError(
                "invalid_argument",
                f"push for round {round} carries {quote(name, 80)}, of fragment {owner}; round {round} syncs fragment {fragment} of {self.cfg.fragments}",
            )

    @property
    def fragments(self) -> tuple[tuple[str, ...], ...]:
        """The split of the parameters into fragments (one fragment, every name, by default)."""
        with self._cv:
            return self._split

    # ---- read-only views -------------------------------------------------------------
    @property
    def specs(self) -> dict[str, TensorSpec]:
        with self._cv:
            return dict(self._specs)

    @property
    def ready(self) -> bool:
        """θ₀ is set (always, unless init=site and no site has sent it yet)."""
        with self._cv:
            return self._ready

    def wait_ready(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._ready, timeout=timeout_s)

    @property
    def committed_rounds(self) -> int:
        with self._cv:
            return self._open

    @property
    def finished(self) -> bool:
        with self._cv:
            return self._open >= self.cfg.total_rounds

    def global_sha256(self) -> str:
        with self._cv:
            return self._hash

    def global_params(self) -> dict[str, torch.Tensor]:
        with self._cv:
            self._wait_published()
            return {n: p.clone() for n, p in self._outer.params.items()} if self._ready else {}

    def bytes_down(self, round: int) -> int:
        with self._cv:
            return self._downlink.bytes_sent(round)

    def left_sites(self) -> dict[str, str]:
        with self._cv:
            return dict(self._left)

    def status(self) -> RoundStatus:
        with self._cv:
            return self._status()

    def _status(self) -> RoundStatus:
        return RoundStatus(committed_rounds=self._open, total_rounds=self.cfg.total_rounds, global_sha256=self._hash)

    @property
    def active_sites(self) -> frozenset[str]:
        with self._cv:
            return self._members.active

    def site_counts(self) -> dict[str, int]:
        """Sites by membership state: active, evicted, left."""
        with self._cv:
            return self._members.counts()

    def site_states(self) -> dict[str, dict[str, Any]]:
        """Site -> {"state": active | evicted | left, "joins", "pushed_s_ago": seconds since its
        push into the open round arrived, or None}: a copy taken under the lock at once (the
        status page's view; diloco/observe/status_state.py)."""
        with self._cv:
            now, pushed = self._clock(), self._round.pushed_at
            return {s: {**m, "pushed_s_ago": now - pushed[s] if s in pushed else None} for s, m in self._members.snapshot().items()}

    def tick(self) -> RoundRecord | None:
        """Evicts sites whose lease ended and closes the round if the policy now allows it.
        Called periodically (``start_ticker``); returns the record of a commit."""
        with self._cv:
            # While a commit is being made durable, evictions wait for the next tick: they
            # belong to the round that opens when it is published.
            evicted = [] if self._committing else self._members.expire()
            if evicted:
                self._round.evicted.extend(evicted)
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
            self.failed = self.failed or f"{what} failed: {type(e).__name__}: {str(e)[:500]}"
            self._cv.notify_all()
        if not self.on_fatal:
            raise e
        for listener in self.on_fatal:
            listener(what, e)

    def _require_healthy(self) -> None:
        if self.failed is not None:
            raise CoordinatorError("unavailable", f"the coordinator has failed ({self.failed}) and must be restarted from its checkpoint; try again later")

    def _require_ready(self) -> None:
        if not self._ready:
            raise CoordinatorError("failed_precondition", "θ₀ is not set yet (init=site): the site chosen at Join must upload it first")

    def _require_member(self, site_id: str) -> None:
        """Every call of a site counts as a heartbeat; an unknown, evicted or departed site is refused."""
        self._require_healthy()
        why = site_id_problem(site_id)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)
        try:
            self._members.renew(site_id)
        except KeyError as e:
            raise CoordinatorError("failed_precondition", e.args[0]) from None

    def _wait_published(self) -> None:
        """Under the lock: waits until no commit is between its computation and its publication."""
        self._cv.wait_for(lambda: not self._committing or self.failed is not None)
        self._require_healthy()

    # ---- pushes (the path in: intake.PushIntake) ------------------------------------------
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
            return [dict(t) for t in self._timings]

    def refusals(self) -> dict[str, int]:
        """Site -> how many of its pushes the norm bound refused over the run."""
        with self._cv:
            return dict(sorted(self._refusals.items()))

    # ---- commits ---------------------------------------------------------------------
    def _maybe_commit(self, times: dict[str, Any] | None = None) -> _Commit | None:
        """Under the lock: closes the open round if the policy allows it. θ moves now; the
        round is published by ``_publish`` once its checkpoint is durable. ``times``: what the
        closing push measured so far (commit_timings)."""
        if not self._ready or self._committing or self._open >= self.cfg.total_rounds:
            return None
        state = self._round
        if not self._policy.should_close(self._clock(), state.opened_at, state.pushed_at, self._members.active):
            return None
        r = state.number
        every = self.cfg.snapshot_every
        closing = Closing(
            active=self._members.active, now=self._clock(), started=self._start, snapshot=(every > 0 and (r + 1) % every == 0) or r + 1 == self.cfg.total_rounds
        )
        times = {"round": r, "closer": None, **(times or {})}
        t0 = time.perf_counter()
        record, update = commit(state, self._outer, self._guard, self._encoder, closing, times)
        times["commit_s"] = time.perf_counter() - t0
        self._participants[r] = record.participants
        self._records[r] = record.summary()
        for old in [k for k in self._records if k <= r - _KEEP_RECORDS]:
            del self._records[old]
        self._site_evals.prune(before=r - _KEEP_RECORDS + 1)
        self._committing = True
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
            self._streamed = record.round
            self._cv.notify_all()
        t_served = time.perf_counter()
        if pending.checkpoint is not None:
            # If this raises, θ has moved but the round cannot be published durably: the
            # coordinator stays "committing" (it never takes the round's pushes twice) and its
            # process must be restarted from the last good checkpoint.
            try:
                save_checkpoint(Path(str(self.cfg.checkpoint_dir)), record.round + 1, pending.checkpoint)
            except Exception as e:
                self._fail(f"the checkpoint of round {record.round}", e)
                raise CoordinatorError("unavailable", f"round {record.round} could not be made durable; the coordinator must restart") from None
        t1 = time.perf_counter()
        with self._cv:
            self._hash = record.global_sha256
            self._open = record.round + 1
            self._committing = False
            self._streamed = None
            # Parts of pushes for rounds that can no longer be taken (refused, or too late to merge).
            stale = self.cfg.quorum.max_staleness if self.cfg.quorum.late == "merge" else 0
            self._parts.prune(lambda rnd: self._open - rnd <= stale)
            self._round = self._open_round(self._open, pending.closed_at)
            self._cv.notify_all()
            self._timings.append(
                {
                    **pending.times,
                    "serve_s": t_served - t0,
                    "checkpoint_s": t1 - t_served,
                    "publish_s": time.perf_counter() - t1,
                    "published_at": time.monotonic(),
                }
            )
        for listener in self.on_commit:
            listener(record)
        return record

    # ---- checkpoints -----------------------------------------------------------------
    def _checkpoint_state(self, committed: int | None = None, global_sha256: str | None = None) -> dict[str, Any]:
        """The state a checkpoint holds (by reference: no commit can move it before it is written)."""
        return {
            "run_id": self.run_id,
            "committed_rounds": self._open if committed is None else committed,
            "global_sha256": self._hash if global_sha256 is None else global_sha256,
            "outer": self._outer.state_dict(),
            "down_residual": self._encoder.feedback.residual if self._encoder.feedback is not None else None,
            "members": self._members.snapshot(),
            "participants": {str(r): list(p) for r, p in self._participants.items()},
            "records": {str(r): rec for r, rec in self._records.items()},
            "guard_history": self._guard.history,
            "robust_history": self._bound.history,
            "refusals": dict(self._refusals),
            "merged_done": sorted(self._merged_done),
            "init_from": self.init_from,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resumes from a checkpoint's state: θ, the outer optimizer, the downlink residual, the
        round and the membership (active sites get a fresh lease). Refuses a state whose θ does
        not hash to the saved value, or one past this run's last round."""
        committed = int(state["committed_rounds"])
        if not 0 <= committed <= self.cfg.total_rounds:
            raise ValueError(f"checkpoint has {committed} committed rounds; this run has {self.cfg.total_rounds}")
        digest = params_sha256(state["outer"]["params"])  # checked before anything is loaded
        if digest != state["global_sha256"]:
            raise ValueError(f"checkpoint θ hashes to {digest[:16]}, the checkpoint says {str(state['global_sha256'])[:16]}")
        with self._cv:
            self._barrier.open = True  # the sites of a restored run are past their start
            if not self._ready:  # init=site: θ₀ was committed before the restart; never asked again
                self._install(state["outer"]["params"], str(state.get("init_from", "the checkpoint")))
            self._outer.load_state_dict(state["outer"])
            self.run_id = str(state["run_id"])
            self._hash = digest
            self._open = committed
            if self._encoder.feedback is not None:
                self._encoder.feedback.carry(state["down_residual"])
            self._participants = {int(r): list(p) for r, p in state["participants"].items()}
            # Sites reconnect with backoff (at most 4 s apart) while this process starts serving.
            self._members.restore(state["members"], grace_s=RESTART_GRACE_S)
            self._records = {int(r): dict(rec) for r, rec in state.get("records", {}).items()}
            self._guard = SpikeGuard(self.cfg.guard, list(state.get("guard_history", [])))
            self._bound = NormBound(self.cfg.robust, [float(x) for x in state.get("robust_history", [])])
            self._refusals = {str(s): int(n) for s, n in state.get("refusals", {}).items()}
            self._merged_done = {(str(s), int(r)) for s, r in state.get("merged_done", [])}
            self._downlink.clear()
            self._parts.clear()
            self._round = self._open_round(committed, self._clock())
            last = self._records.get(committed - 1)
            if last is not None:  # elapsed_s goes on from where the predecessor stopped
                self._start = self._round.opened_at - float(last["elapsed_s"])

    def late_pushes(self, round: int) -> list[dict[str, Any]]:
        """Pushes ({"site", "round"}) that arrived while ``round`` was open, for rounds committed
        without them; for the last round, also those that arrived after it was committed."""
        with self._cv:
            last = round + 1 >= self.cfg.total_rounds
            return [p for r in sorted(self._late) if r == round or (last and r > round) for p in self._late[r]]

    def recent_records(self) -> dict[int, dict[str, Any]]:
        """RoundRecord.summary() of the last few committed rounds (restored from a checkpoint
        too: a restarted coordinator rewrites the metrics lines its predecessor had not)."""
        with self._cv:
            return {r: dict(rec) for r, rec in self._records.items()}

    def round_settled(self, round: int) -> bool:
        """True once no more pulls of ``round``'s update are expected: the next round is
        committed (every participant has pulled it) or every site has left."""
        with self._cv:
            return self._open > round + 1 or (self._open > round and not self._members.active)

    def wait_all_left(self, timeout_s: float) -> bool:
        """After the last round: waits until every site has left, evicted ones too (a site cut
        off near the end comes back, joins again, pulls θ and leaves); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._open >= self.cfg.total_rounds and not self._members.not_left, timeout=timeout_s)
