"""Round bookkeeping of the coordinator: joins, pushes, commits, pulls.

Threading: every public method may be called from any gRPC worker thread. One condition
variable guards the round state; decoding a push happens outside it (in a staging buffer
from a bounded pool), so memory is O(params × max_concurrent_pushes), never O(sites ×
params), and a push that fails half-way leaves the round untouched.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.boxes import Box
from diloco.codec import ChunkAssembler, CodecConfig, CodecError, check_part, codec_config, encode_chunks, get_codec, is_lossless
from diloco.codec.chunks import MAX_CHUNK_BYTES
from diloco.checkpoint import save_checkpoint
from diloco.coordinator.errors import CoordinatorError
from diloco.coordinator.fingerprint import fingerprint, mismatches
from diloco.coordinator.init_source import InitElection, clip as _clip, decode_upload, upload_problem
from diloco.coordinator.guard import GuardConfig, SpikeGuard
from diloco.coordinator.downlink import Downlink
from diloco.coordinator.membership import Membership
from diloco.coordinator.parts import PartialPushes
from diloco.coordinator.round_policy import RoundPolicy
from diloco.coordinator.site_evals import SiteEvals
from diloco.outer import AGGREGATES, OuterConfig, OuterOptimizer, WeightedMean, params_sha256
from diloco.types import Chunk, JoinInfo, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec


@dataclass(frozen=True)
class CoordinatorConfig:
    total_rounds: int
    min_sites: int = 1  # a round never closes with fewer pushes than this
    lease_s: float = 60.0  # a site silent (no call, no heartbeat) this long is evicted
    deadline: str = "none"  # none: wait for every active site; fixed / median: see RoundPolicy
    deadline_s: float = 60.0
    deadline_factor: float = 1.5
    codec_down: CodecConfig | str = "fp32"  # the update's encoding (a config, or a wire name)
    error_feedback_down: bool = True  # carry the downlink codec's error into the next update
    aggregate: str = "mean"  # mean | nonzero: see WeightedMean
    chunk_bytes: int = MAX_CHUNK_BYTES
    max_concurrent_pushes: int = 2  # staging buffers; bounds decode memory independent of sites
    keep_updates: int = 2  # committed updates kept for PullUpdate; older ones need PullGlobal
    snapshot_every: int = 0  # attach a copy of θ to every k-th RoundRecord (0: never; last round always)
    checkpoint_dir: str | None = None  # write an atomic checkpoint here after every commit, before publishing it
    guard: GuardConfig = field(default_factory=GuardConfig)  # the loss-spike guard (off by default)
    late: str = "drop"  # late pushes: drop (refused, ABORTED) | merge (into the open round, discounted)
    late_discount: float = 0.5  # merge weight: tokens x late_discount ** staleness
    max_staleness: int = 2  # merge only pushes at most this many rounds late
    sync_every: int | None = None  # the run's H: a site that says another one is refused at Join
    codec_up: str | None = None  # the uplink codec's wire name: a site that says another one is refused
    init_source: str = "the run's model config"  # where θ₀ comes from, named in Join refusals
    site_eval_every: int = 0  # evaluation by sites: they evaluate θ after every k-th round (0: the coordinator evaluates, or nobody)

    def __post_init__(self) -> None:
        for name in ("total_rounds", "min_sites", "max_concurrent_pushes", "keep_updates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        codec_config(self.codec_down)
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={self.aggregate!r}: must be one of {', '.join(AGGREGATES)}")
        self.policy  # checks the deadline fields

    @property
    def policy(self) -> RoundPolicy:
        return RoundPolicy(min_sites=self.min_sites, deadline=self.deadline, deadline_s=self.deadline_s, deadline_factor=self.deadline_factor)


@dataclass
class RoundRecord:
    """What happened in one committed round; handed to ``on_commit`` listeners."""

    round: int
    participants: list[str]
    tokens: int
    inner_steps: int
    bytes_up: int
    train_loss: float | None
    update_norm: float
    global_sha256: str
    wall_s: float  # from the round's opening (previous commit or start) to its commit
    elapsed_s: float  # from coordinator start to this commit
    params: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    delta_norm: float = 0.0  # of the participants' weighted mean Δ (what the guard judges)
    rejected: bool = False  # the guard rejected the round: θ did not move
    guard: str | None = None  # the guard's figures when it rejected the round
    absent: list[str] = field(default_factory=list)  # active sites that did not push this round
    merged: list[dict[str, Any]] = field(default_factory=list)  # late pushes merged in: site, round, weight factor, tokens
    evicted: list[str] = field(default_factory=list)  # sites whose lease ended while the round was open
    # sharded sites' pushes: site -> per part {part, whole: tensors sent whole, sliced: tensors sent as slices, numel}
    sliced: dict[str, list[dict[str, int]]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Everything but the θ snapshot (kept in checkpoints, to rewrite lost metrics lines)."""
        return {k: v for k, v in self.__dict__.items() if k != "params"}


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
        self._outer_cfg = outer
        self._election = InitElection(cfg.lease_s, clock)
        self._site_evals = SiteEvals()  # evaluation by the sites
        self.on_init: list[Callable[[str], None]] = []  # called with who sent θ₀ (init=site)
        self._cv = threading.Condition()
        self._members = Membership(cfg.lease_s, clock)
        self._left: dict[str, str] = {}  # site id -> the hash it reported when leaving
        self._pushed_at: dict[str, float] = {}  # this round's pushes: site id -> arrival time
        self._open = 0
        self._pushes: dict[str, PushHeader] = {}
        self._push_bytes = 0
        self._participants: dict[int, list[str]] = {}
        self._ready = False  # θ₀ is set
        self._specs: dict[str, TensorSpec] = {}
        self._downlink = Downlink(self._specs, cfg.keep_updates)  # what pullers get
        self._hash = ""
        self.init_from = "a site (init=site), not yet"  # who θ₀ came from, named in messages
        if params is not None:
            self._install(params, cfg.init_source)
        self._codec_down = codec_config(cfg.codec_down).build()
        self._down_residual: dict[str, torch.Tensor] | None = None
        self._start = clock()
        self._round_start = self._start
        self._staging: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        for _ in range(cfg.max_concurrent_pushes):
            self._staging.put({})
        self._guard = SpikeGuard(cfg.guard)
        # open round -> pushes refused while it was open, for rounds already closed without them
        self._late: dict[int, list[dict[str, Any]]] = {}
        self._evicted: list[str] = []  # evicted while the open round was open
        self._records: dict[int, dict[str, Any]] = {}  # the last few rounds' RoundRecord.summary()
        self._merged: list[dict[str, Any]] = []  # late pushes merged into the open round
        self._merged_done: set[tuple[str, int]] = set()  # (site, round) of every merged push (repeats are duplicates)
        self._parts = PartialPushes()  # parts of sharded sites' pushes, until each site's last part
        self._sliced: dict[str, list[dict[str, int]]] = {}  # what the open round's sharded pushes held
        self.on_commit: list[Callable[[RoundRecord], None]] = []
        self.on_push: list[Callable[[int], None]] = []  # called with the round after each accepted push

    def _install(self, params: Mapping[str, torch.Tensor], source: str) -> None:
        """θ₀ and everything sized by it: the outer optimizer, the accumulator, the downlink."""
        self._outer = OuterOptimizer(params, self._outer_cfg)
        self._specs = fingerprint(self._outer.params)
        self._shapes = {n: p.shape for n, p in self._outer.params.items()}
        self._acc = WeightedMean(self._shapes, self.cfg.aggregate)
        self._downlink = Downlink(self._specs, self.cfg.keep_updates)
        self._hash = params_sha256(self._outer.params)
        self.init_from = source
        self._ready = True

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
        return RoundStatus(self._open, self._open, self.cfg.total_rounds, self._hash)

    # ---- membership ------------------------------------------------------------------
    def join(self, site_id: str, specs: Iterable[TensorSpec], *, can_upload: bool = False, sync_every: int = 0, codec: str = "") -> JoinInfo:
        """Admits a site whose model matches θ's fingerprint. Before θ₀ exists (init=site) the
        first site that can upload becomes its source (``JoinInfo.upload_init``); the others
        wait here for it, up to ``JOIN_WAIT_S``, then are told to try again (unavailable)."""
        if not site_id:
            raise CoordinatorError("invalid_argument", "site_id must not be empty")
        self._check_settings(site_id, sync_every, codec)
        specs = list(specs)
        with self._cv:
            give_up = time.monotonic() + JOIN_WAIT_S
            while not self._ready:
                if can_upload:
                    declared = {s.name: s for s in specs}
                    why = upload_problem(declared, len(specs))
                    if why is not None:
                        raise CoordinatorError("invalid_argument", f"site {site_id!r} cannot send θ₀: {why}")
                    if self._election.choose(site_id, declared):
                        self._admit(site_id)
                        return self._join_info(upload_init=True)
                left = give_up - time.monotonic()
                if left <= 0:
                    who = f"site {self._election.source!r} is sending it" if not self._election.free() else "waiting for a site that can send it"
                    raise CoordinatorError("unavailable", f"θ₀ is not set yet (init=site): {who}; join again shortly")
                self._cv.wait(timeout=min(left, 0.5))  # wakes to see whether the source timed out
            problems = mismatches(self._specs, specs)
            if problems:
                raise CoordinatorError(
                    "invalid_argument", f"model of site {site_id!r} does not match the coordinator's (θ₀ from {self.init_from}): " + "; ".join(problems)
                )
            self._admit(site_id)
            return self._join_info()

    def _admit(self, site_id: str) -> None:
        self._members.join(site_id)
        self._left.pop(site_id, None)
        # A site that (re)joins starts its rounds afresh: parts an earlier incarnation of it
        # pushed must not be combined with the parts of this one.
        self._parts.discard_site(site_id)

    def _join_info(self, upload_init: bool = False) -> JoinInfo:
        return JoinInfo(
            open_round=self._open, total_rounds=self.cfg.total_rounds, run_id=self.run_id, lease_s=self.cfg.lease_s, upload_init=upload_init,
            eval_every=self.cfg.site_eval_every,
        )  # fmt: skip

    def _check_settings(self, site_id: str, sync_every: int, codec: str) -> None:
        """A site that says its H or its uplink codec must say the coordinator's."""
        if sync_every and self.cfg.sync_every is not None and sync_every != self.cfg.sync_every:
            raise CoordinatorError(
                "invalid_argument", f"site {site_id!r} has sync_every={sync_every}, this run has sync_every={self.cfg.sync_every}: use the run's value"
            )
        if codec and self.cfg.codec_up is not None and codec != self.cfg.codec_up:
            raise CoordinatorError("invalid_argument", f"site {site_id!r} pushes with codec={_clip(codec)}, this run's codec is {self.cfg.codec_up}: use the run's codec")

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """θ₀ from the site that Join chose as its source (init=site): every tensor it declared,
        whole, float32, finite, sent lossless; all or nothing. A refused upload leaves θ₀ unset
        and the role to the next site that joins; an accepted one is checkpointed (round 0)
        before any site can pull it, so a restarted coordinator never asks again."""
        site = header.site_id
        with self._cv:
            if self._ready:
                raise CoordinatorError("failed_precondition", f"θ₀ is already set (from {self.init_from}); join again to pull it")
            why = self._election.start(site)
            if why is not None:
                raise CoordinatorError("failed_precondition", why)
            specs = dict(self._election.specs)
        def keep_alive() -> None:
            with self._cv:
                try:
                    self._members.renew(site)
                except KeyError as e:
                    raise CodecError(f"the upload stopped counting: {e.args[0]}") from None

        try:
            params, payload_bytes = decode_upload(specs, chunks, keep_alive)
        except BaseException as e:
            reason = str(e) if isinstance(e, CodecError) else f"the upload broke off ({type(e).__name__})"
            with self._cv:
                self._election.release(site, reason)
                self._members.leave(site)  # it holds no round open; the next site takes the role
                self._cv.notify_all()
            if isinstance(e, CodecError):
                raise CoordinatorError("invalid_argument", f"θ₀ from site {site!r} refused: {e}") from None
            raise
        with self._cv:
            self._install(params, f"site {site!r}")
            if self.cfg.checkpoint_dir is not None:
                save_checkpoint(Path(self.cfg.checkpoint_dir), 0, self._checkpoint_state())
            self._round_start = self._clock()
            self._cv.notify_all()
        for listener in self.on_init:
            listener(self.init_from)
        return PushResult(accepted=True, duplicate=False, round=0, payload_bytes=payload_bytes)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        with self._cv:
            if self._members.state(site_id) is None:
                raise CoordinatorError("failed_precondition", self._members.why_not_active(site_id))
            if eval is not None:
                self._check_eval(site_id, eval)
                self._site_evals.add(site_id, eval)
            self._members.leave(site_id)
            self._left[site_id] = global_sha256
            self._cv.notify_all()

    def _check_eval(self, site_id: str, e: SiteEval) -> None:
        why = SiteEvals.problem(site_id, e, self._open)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)

    def site_eval(self, round: int) -> dict[str, Any] | None:
        """The sites' evaluation of θ after ``round`` (SiteEvals.mean)."""
        with self._cv:
            return self._site_evals.mean(round)

    def heartbeat(self, site_id: str) -> RoundStatus:
        """Renews the site's lease; refused (failed_precondition) once it was evicted."""
        with self._cv:
            self._require_member(site_id)
            return self._status()

    def tick(self) -> RoundRecord | None:
        """Evicts sites whose lease ended and closes the round if the policy now allows it.
        Called periodically (``start_ticker``); returns the record of a commit."""
        with self._cv:
            evicted = self._members.expire()
            if evicted:
                self._evicted.extend(evicted)
                self._cv.notify_all()
            record = self._maybe_commit() if self._ready and self._open < self.cfg.total_rounds else None
        if record is not None:
            for listener in self.on_commit:
                listener(record)
        return record

    def start_ticker(self, interval_s: float = 0.2) -> Callable[[], None]:
        """Runs ``tick`` every ``interval_s`` on a daemon thread; returns the function that stops it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.tick()

        thread = threading.Thread(target=loop, name="coordinator-ticker", daemon=True)
        thread.start()

        def stop_ticker() -> None:
            stop.set()
            thread.join()

        return stop_ticker

    @property
    def active_sites(self) -> frozenset[str]:
        with self._cv:
            return self._members.active

    def _require_ready(self) -> None:
        if not self._ready:
            raise CoordinatorError("failed_precondition", "θ₀ is not set yet (init=site): the site chosen at Join must upload it first")

    def _record_eval(self, header: PushHeader) -> None:
        """Keeps the evaluation an accepted push carried (checked in _check_push)."""
        if header.eval is not None:
            self._site_evals.add(header.site_id, header.eval)

    def _require_member(self, site_id: str) -> None:
        """Every call of a site counts as a heartbeat; an unknown, evicted or departed site is refused."""
        try:
            self._members.renew(site_id)
        except KeyError as e:
            raise CoordinatorError("failed_precondition", e.args[0]) from None

    # ---- pushes ----------------------------------------------------------------------
    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """Accepts one site's whole pseudo-gradient for one round, or nothing of it. A part of
        a sharded site's push (``header.parts > 1``) waits until every part has arrived."""
        if header.parts > 1:
            return self._push_part(header, chunks)
        with self._cv:
            verdict = self._check_push(header)
        if verdict == "duplicate":
            return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
        return self._take(header, chunks)

    def _take(self, header: PushHeader, chunks: Iterable[Chunk], sliced: list[dict[str, int]] | None = None) -> PushResult:
        """Decodes a whole push into a staging buffer, then adds it to the round (or merges it).
        ``sliced``: what the parts of a sharded push held (for the round's record)."""
        staging = self._staging.get()
        try:
            assembler = ChunkAssembler(self._specs, out=staging)
            try:
                for chunk in chunks:
                    if chunk.round != header.round:
                        raise CodecError(f"chunk of {chunk.name!r} is for round {chunk.round}, header says {header.round}")
                    assembler.add(chunk)
                delta = assembler.finish()
            except CodecError as e:
                raise CoordinatorError("invalid_argument", f"push of site {header.site_id!r} for round {header.round} rejected: {e}") from None
            with self._cv:
                # The round may have moved on while we decoded; check again before touching it.
                verdict = self._check_push(header)
                if verdict == "duplicate":
                    return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
                merged_into = 0
                self._record_eval(header)
                if verdict == "merge":
                    factor = self.cfg.late_discount ** (self._open - header.round)
                    self._acc.add(delta, float(header.tokens) * factor)
                    self._merged.append({"site": header.site_id, "round": header.round, "weight": factor, "tokens": header.tokens})
                    self._merged_done.add((header.site_id, header.round))
                    merged_into = self._open
                else:
                    self._acc.add(delta, float(header.tokens))
                    self._pushes[header.site_id] = header
                    self._pushed_at[header.site_id] = self._clock()
                    if sliced is not None:
                        self._sliced[header.site_id] = sliced
                self._push_bytes += assembler.payload_bytes
                record = self._maybe_commit()
        finally:
            self._staging.put(staging)
        for push_listener in self.on_push:
            push_listener(header.round)
        if record is not None:
            for listener in self.on_commit:
                listener(record)
        return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=assembler.payload_bytes, merged_into=merged_into)

    def _push_part(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """One rank's slices of a sharded site's push: checked now, kept encoded, and taken as
        one whole push (the slices must tile every tensor) when the site's last part arrives."""
        what = f"push part {header.part} of {header.parts} of site {header.site_id!r} for round {header.round}"
        why = PartialPushes.check_header(header)
        if why is not None:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {why}")
        with self._cv:
            verdict = self._check_push(header)
        if verdict == "duplicate":
            return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
        try:
            kept, boxes, payload = check_part(self._specs, chunks, header.round)
        except CodecError as e:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
        with self._cv:
            try:
                verdict = self._check_push(header)
            except CoordinatorError:
                self._parts.discard(header.site_id, header.round)  # late and refused: the other parts go too
                raise
            if verdict == "duplicate":
                return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
            try:
                state, every = self._parts.add(header, kept, boxes)
            except ValueError as e:
                raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
            if state != "duplicate":
                self._record_eval(header)
        if state == "duplicate":
            return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
        if state == "waiting":
            return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=payload)
        described = [_describe_part(p, chunks, self._specs) for p, chunks in every.items()]
        result = self._take(header, (c for part in every.values() for c in part), sliced=described)
        return PushResult(accepted=result.accepted, duplicate=result.duplicate, round=result.round, payload_bytes=payload, merged_into=result.merged_into)

    def _check_push(self, header: PushHeader) -> str:
        """"take" (a push for the open round), "merge" (a late push the policy folds into the
        open round) or "duplicate" (a harmless repeat); raises if the push cannot be taken."""
        self._require_member(header.site_id)
        self._require_ready()
        if header.eval is not None:
            self._check_eval(header.site_id, header.eval)
        if header.tokens <= 0:
            raise CoordinatorError("invalid_argument", f"push of site {header.site_id!r} declares tokens={header.tokens}; must be > 0")
        if header.round >= self.cfg.total_rounds:
            raise CoordinatorError("out_of_range", f"round {header.round} is past the last round ({self.cfg.total_rounds - 1}) of this run")
        if header.round < self._open:
            if header.site_id in self._participants.get(header.round, ()) or (header.site_id, header.round) in self._merged_done:
                return "duplicate"
            mergeable = self._open < self.cfg.total_rounds and self._open - header.round <= self.cfg.max_staleness
            if self.cfg.late == "merge" and mergeable:
                return "merge"
            late = self._late.setdefault(self._open, [])
            if {"site": header.site_id, "round": header.round} not in late:
                late.append({"site": header.site_id, "round": header.round})
            raise CoordinatorError(
                "aborted", f"round {header.round} was committed without site {header.site_id!r} (open round is {self._open}); pull the global parameters and go on"
            )
        if header.round > self._open:
            raise CoordinatorError("failed_precondition", f"round {header.round} is not open (open round is {self._open})")
        return "duplicate" if header.site_id in self._pushes else "take"

    def _maybe_commit(self) -> RoundRecord | None:
        pushed = set(self._pushes)
        if not self._policy.should_close(self._clock(), self._round_start, self._pushed_at, self._members.active):
            return None
        r = self._open
        mean = self._acc.mean()
        verdict = self._guard.judge(_norm(mean))
        if verdict.accepted:
            update = self._outer.step(mean, transmit=lambda u: self._transmit(r, u))
        else:
            # θ, the outer optimizer and the downlink residual stay; sites apply a zero update.
            update = {n: torch.zeros_like(p) for n, p in self._outer.params.items()}
            self._downlink.put_update(r, list(encode_chunks(update, codec=self._codec_down, round=r, chunk_bytes=self.cfg.chunk_bytes)))
        self._hash = params_sha256(self._outer.params)
        now = self._clock()
        headers = [self._pushes[s] for s in sorted(pushed)]
        tokens = sum(h.tokens for h in headers)
        every = self.cfg.snapshot_every
        snapshot = (every > 0 and (r + 1) % every == 0) or r + 1 == self.cfg.total_rounds
        record = RoundRecord(
            round=r,
            participants=sorted(pushed),
            tokens=tokens,
            inner_steps=sum(h.inner_steps for h in headers),
            bytes_up=self._push_bytes,
            train_loss=_weighted_loss(headers),
            update_norm=_norm(update),
            delta_norm=verdict.norm,
            rejected=not verdict.accepted,
            guard=None if verdict.accepted else verdict.describe(),
            absent=sorted(self._members.active - pushed),
            merged=list(self._merged),
            sliced={site: parts for site, parts in sorted(self._sliced.items()) if site in pushed},
            evicted=sorted(set(self._evicted)),
            global_sha256=self._hash,
            wall_s=now - self._round_start,
            elapsed_s=now - self._start,
            params={n: p.clone() for n, p in self._outer.params.items()} if snapshot else None,
        )
        self._participants[r] = record.participants
        self._records[r] = record.summary()
        for old in [k for k in self._records if k <= r - _KEEP_RECORDS]:
            del self._records[old]
        self._site_evals.prune(before=r - _KEEP_RECORDS + 1)
        self._evicted = []
        self._merged = []
        self._sliced = {}
        self._open = r + 1
        # Parts of pushes for rounds that can no longer be taken (refused, or too late to merge).
        stale = self.cfg.max_staleness if self.cfg.late == "merge" else 0
        self._parts.prune(lambda rnd: self._open - rnd <= stale)
        if self.cfg.checkpoint_dir is not None:
            # Before any site can see the round committed: a restart never loses a published round.
            save_checkpoint(Path(self.cfg.checkpoint_dir), self._open, self._checkpoint_state())
        self._round_start = now
        self._acc = WeightedMean(self._shapes, self.cfg.aggregate)
        self._pushes = {}
        self._pushed_at = {}
        self._push_bytes = 0
        self._cv.notify_all()
        return record

    def _transmit(self, r: int, proposed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Encodes round r's update once (kept for PullUpdate) and returns it decoded, exactly
        as every site will decode it. The encoding error is carried into the next round's
        update (server-side error feedback), so a lossy downlink loses nothing over time."""
        if self._down_residual is not None:
            proposed = {n: u + self._down_residual[n] for n, u in proposed.items()}
        chunks = list(encode_chunks(proposed, codec=self._codec_down, round=r, chunk_bytes=self.cfg.chunk_bytes))
        assembler = ChunkAssembler(self._specs)
        for c in chunks:
            assembler.add(c)
        sent = assembler.finish()
        if self.cfg.error_feedback_down and not is_lossless(self._codec_down.name):
            self._down_residual = {n: proposed[n] - sent[n] for n in proposed}
        self._downlink.put_update(r, chunks)
        return sent

    # ---- checkpoints -----------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "committed_rounds": self._open,
            "global_sha256": self._hash,
            "outer": self._outer.state_dict(),
            "down_residual": self._down_residual,
            "members": self._members.snapshot(),
            "participants": {str(r): list(p) for r, p in self._participants.items()},
            "records": {str(r): rec for r, rec in self._records.items()},
            "guard_history": self._guard.history,
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
            if not self._ready:  # init=site: θ₀ was committed before the restart; never asked again
                self._install(state["outer"]["params"], str(state.get("init_from", "the checkpoint")))
            self._outer.load_state_dict(state["outer"])
            self.run_id = str(state["run_id"])
            self._hash = digest
            self._open = committed
            self._down_residual = state["down_residual"]
            self._participants = {int(r): list(p) for r, p in state["participants"].items()}
            # Sites reconnect with backoff (at most 4 s apart) while this process starts serving.
            self._members.restore(state["members"], grace_s=RESTART_GRACE_S)
            self._records = {int(r): dict(rec) for r, rec in state.get("records", {}).items()}
            self._guard = SpikeGuard(self.cfg.guard, list(state.get("guard_history", [])))
            self._merged_done = {(str(s), int(r)) for s, r in state.get("merged_done", [])}
            self._merged = []
            self._acc = WeightedMean(self._shapes, self.cfg.aggregate)
            self._pushes, self._pushed_at, self._push_bytes = {}, {}, 0
            self._downlink.clear()
            self._parts.clear()
            self._round_start = self._clock()
            last = self._records.get(committed - 1)
            if last is not None:  # elapsed_s goes on from where the predecessor stopped
                self._start = self._round_start - float(last["elapsed_s"])

    # ---- pulls -----------------------------------------------------------------------
    def wait_round(self, site_id: str, round: int, timeout_s: float) -> RoundStatus:
        """Blocks until ``round`` is committed or ``timeout_s`` passes; returns the status."""
        with self._cv:
            self._require_member(site_id)
            self._require_ready()
            self._cv.wait_for(lambda: self._open > round, timeout=max(0.0, timeout_s))
            return self._status()

    def pull_update(self, site_id: str, round: int, want: Mapping[str, Box] | None = None) -> list[Chunk]:
        """The encoded update of committed round ``round``; with ``want`` (name -> slice), only
        the chunks that hold rows of those slices (what one rank of a sharded site needs)."""
        with self._cv:
            self._require_member(site_id)
            self._require_ready()
            self._downlink.check_want(want)
            if round >= self._open:
                raise CoordinatorError("failed_precondition", f"round {round} is not committed yet (committed rounds: {self._open})")
            return self._downlink.update(round, want)

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> list[Chunk]:
        """θ after the last committed round, float32, tagged with the open round number (with
        ``want``: only the chunks that hold rows of those slices)."""
        with self._cv:
            self._require_member(site_id)
            self._require_ready()
            self._downlink.check_want(want)
            open_round = self._open

            def encode() -> list[Chunk]:
                return list(encode_chunks(self._outer.params, codec=get_codec("fp32"), round=open_round, chunk_bytes=self.cfg.chunk_bytes))

            return self._downlink.global_params(open_round, encode, want)

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


_KEEP_RECORDS = 16
RESTART_GRACE_S = 10.0  # added to the restored members' first lease after a restart
JOIN_WAIT_S = 20.0  # init=site: how long a Join waits for θ₀ before it is told to try again


def _describe_part(part: int, chunks: list[Chunk], specs: Mapping[str, TensorSpec]) -> dict[str, int]:
    """One part of a sharded push: how many tensors it sent whole, how many as slices, and
    how many elements in all."""
    whole = {c.name for c in chunks if c.box.is_whole(specs[c.name].shape)}
    sliced = {c.name for c in chunks} - whole
    return {"part": part, "whole": len(whole), "sliced": len(sliced), "numel": sum(c.numel for c in chunks)}


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())))


def _weighted_loss(headers: list[PushHeader]) -> float | None:
    """Token-weighted mean of the reported inner losses; sites that report none (NaN) are skipped."""
    finite = [h for h in headers if math.isfinite(h.train_loss)]
    if not finite:
        return None
    return sum(h.train_loss * h.tokens for h in finite) / sum(h.tokens for h in finite)
