"""A site's session with the coordinator, as calls: its join (checked against θ's fingerprint
and the run's settings; with init=site the election of the site that sends θ₀, and that
upload), its heartbeats, and its leave with the hash of its θ and its evaluation.

``Joins`` sequences the parts on the coordinator's lock: the sessions (who is in), the shard
(θ's fingerprint and split), the intake (a rejoining site's stale parts) and the round book.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from diloco.codec import CodecError
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.gate import Gate
from diloco.coordinator.init_source import InitParts, checked_upload, decode_upload, upload_problem
from diloco.coordinator.intake import Intake
from diloco.coordinator.round_book import RoundBook
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shards import ShardSet
from diloco.errors import CoordinatorError
from diloco.security.ids import quote, site_id_problem
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval
from diloco.wire import check_part, mismatches

JOIN_WAIT_S = 20.0  # init=site: how long a Join waits for θ₀ before it is told to try again


class Joins:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        gate: Gate,
        sessions: Sessions,
        shard: ShardSet,
        intake: Intake,
        book: RoundBook,
        *,
        run_id: Callable[[], str],
        install: Callable[[Mapping[str, torch.Tensor], str], None],
        status: Callable[[], RoundStatus],
        on_init: list[Callable[[str], None]],
    ) -> None:
        """``install``: θ₀ from a site, made durable (called under the lock); ``status``: the
        round status (under the lock)."""
        self.cfg, self.gate, self.sessions, self.shard, self.intake, self.book = cfg, gate, sessions, shard, intake, book
        self._run_id, self._install, self._status, self._on_init = run_id, install, status, on_init
        self._init_parts: InitParts | None = None  # θ₀ from a multi-rank source, until its last part

    def join(self, request: JoinRequest) -> JoinInfo:
        """Admits a site whose model matches θ's fingerprint and whose stated settings are the
        run's; answers with the run's settings. Before θ₀ exists (init=site) the first site that
        can upload becomes its source (``JoinInfo.upload_init``); the others wait here for it,
        up to ``JOIN_WAIT_S``, then are told to try again (unavailable)."""
        site_id, specs = request.site_id, list(request.specs)
        why = site_id_problem(site_id)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)
        self._check_settings(site_id, request.stated)
        with self.gate.cv:
            self.gate.healthy()
            self.sessions.check_admissible(site_id)
            give_up = time.monotonic() + JOIN_WAIT_S
            while not self.shard.ready:
                if request.can_upload:
                    declared = {s.name: s for s in specs}
                    why = upload_problem(declared, len(specs))
                    if why is not None:
                        raise CoordinatorError("invalid_argument", f"site {site_id!r} cannot send θ₀: {why}")
                    if self.sessions.election.choose(site_id, declared):
                        self._admit(site_id)
                        return self._info(upload_init=True)
                left = give_up - time.monotonic()
                if left <= 0:
                    election = self.sessions.election
                    who = f"site {election.source!r} is sending it" if not election.free() else "waiting for a site that can send it"
                    raise CoordinatorError("unavailable", f"θ₀ is not set yet (init=site): {who}; join again shortly")
                self.gate.cv.wait(timeout=min(left, 0.5))  # wakes to see whether the source timed out
            problems = mismatches(self.shard.specs, specs)
            if problems:
                raise CoordinatorError(
                    "invalid_argument",
                    f"model of site {site_id!r} does not match the coordinator's (θ₀ from {self.shard.init_from}): " + "; ".join(problems)[:2000],
                )
            self._admit(site_id)
            return self._info()

    def _admit(self, site_id: str) -> None:
        self.sessions.admit(site_id)
        # A site that (re)joins starts its rounds afresh: parts an earlier incarnation of it
        # pushed must not be combined with the parts of this one.
        self.intake.parts.discard_site(site_id)

    def _info(self, upload_init: bool = False) -> JoinInfo:
        settings = self.cfg.settings
        return JoinInfo(
            total_rounds=self.cfg.total_rounds,
            run_id=self._run_id(),
            lease_s=self.cfg.quorum.lease_s,
            upload_init=upload_init,
            eval_every=self.cfg.site_eval_every,
            settings=settings.to_dict() if settings is not None else None,
            fragments=self.shard.split if self.shard.ready else (),
        )

    def _check_settings(self, site_id: str, stated: Mapping[str, Any]) -> None:
        """A site that states a run setting must state the run's (a coordinator without settings checks none)."""
        if self.cfg.settings is None or not stated:
            return
        conflicts = self.cfg.settings.conflicts(stated)
        if conflicts:
            raise CoordinatorError(
                "invalid_argument",
                f"site {site_id!r} states settings other than this run's: {'; '.join(conflicts[:8])}; use the run's values or leave them unset",
            )

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """θ₀ from the site that Join chose as its source (init=site): every tensor it declared,
        float32, finite, sent lossless; whole from a one-rank site, or one part per rank
        (``header.parts``) whose slices tile every tensor once. All or nothing: a refused
        upload (any part) leaves θ₀ unset and the role to the next site that joins; an
        accepted one is checkpointed (round 0) before any site can pull it, so a restarted
        coordinator never asks again."""
        self.intake.check_header(header, "upload of θ₀")
        site, sliced = header.site_id, header.parts > 1
        with self.gate.cv:
            self.gate.healthy()
            if self.shard.ready:
                raise CoordinatorError("failed_precondition", f"θ₀ is already set (from {self.shard.init_from}); join again to pull it")
            election = self.sessions.election
            if self._init_parts is not None and (self._init_parts.site_id != election.source or not sliced):
                self._init_parts = None  # a source that timed out, or one that sends whole now
            why = election.start(site, part=sliced and self._init_parts is not None)
            if why is None and sliced:
                if self._init_parts is None:
                    self._init_parts = InitParts(site, header.parts, election.specs)
                why = self._init_parts.problem(site, header.part, header.parts)
                if why is not None:
                    election.part_done(site)
            if why is not None:
                raise CoordinatorError("failed_precondition", why)
            specs, parts = dict(election.specs), self._init_parts

        def keep_alive() -> None:
            with self.gate.cv:
                try:
                    self.sessions.members.renew(site)
                except KeyError as e:
                    raise CodecError(f"the upload stopped counting: {e.args[0]}") from None

        try:
            if sliced:
                kept, _, payload_bytes = check_part(specs, checked_upload(chunks, keep_alive, sliced=True))
                with self.gate.cv:
                    if self._init_parts is not parts or parts is None:
                        raise CodecError("another part of this upload was refused, or the source lost its role")
                    params = parts.add(header.part, kept, payload_bytes)
                    self.sessions.election.part_done(site)
                    if params is None:  # the other ranks' parts are still to come
                        return PushResult(accepted=True, duplicate=False, round=0, payload_bytes=payload_bytes)
                    self._init_parts = None
                    payload_bytes = parts.payload_bytes
            else:
                params, payload_bytes = decode_upload(specs, chunks, keep_alive)
        except BaseException as e:
            reason = str(e) if isinstance(e, CodecError) else f"the upload broke off ({type(e).__name__})"
            with self.gate.cv:
                if self._init_parts is parts:
                    self._init_parts = None
                self.sessions.election.release(site, reason)
                self.sessions.members.leave(site)  # it holds no round open; the next site takes the role
                self.gate.cv.notify_all()
            if isinstance(e, CodecError):
                part = f" (part {header.part} of {header.parts})" if sliced else ""
                raise CoordinatorError("invalid_argument", f"θ₀ from site {site!r}{part} refused: {e}") from None
            raise
        with self.gate.cv:
            # θ₀ is installed and checkpointed under the lock: until it is, no site can push or
            # pull anything, so there is nothing for the lock to hold up.
            self._install(params, f"site {site!r}")
            self.gate.cv.notify_all()
        for listener in self._on_init:
            listener(self.shard.init_from)
        return PushResult(accepted=True, duplicate=False, round=0, payload_bytes=payload_bytes)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        if global_sha256 and not (len(global_sha256) == 64 and all(c in "0123456789abcdef" for c in global_sha256)):
            raise CoordinatorError("invalid_argument", f"global_sha256={quote(global_sha256)}: must be empty or 64 lowercase hex digits")
        with self.gate.cv:
            self.gate.healthy()
            why = site_id_problem(site_id)
            if why is not None:
                raise CoordinatorError("invalid_argument", why)
            if self.sessions.members.state(site_id) is None:
                raise CoordinatorError("failed_precondition", self.sessions.members.why_not_active(site_id))
            if eval is not None:
                self.sessions.check_eval(site_id, eval, self.book.open)
                self.sessions.evals.add(site_id, eval)
            self.sessions.leave(site_id, global_sha256)
            self.gate.cv.notify_all()

    def heartbeat(self, site_id: str) -> RoundStatus:
        """Renews the site's lease; refused (failed_precondition) once it was evicted."""
        with self.gate.cv:
            self.gate.member(site_id)
            return self._status()
