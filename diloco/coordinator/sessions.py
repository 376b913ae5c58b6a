"""The coordinator's side of a site's session: its join (checked against θ's fingerprint and
the run's settings; with init=site the election of the site that sends θ₀, and that upload),
its heartbeats, its leave with the hash of its θ and its evaluation.

``SiteSessions`` is a part of ``Coordinator`` (a mixin, as ``PushIntake`` is): it works on the
coordinator's lock, members and θ, declared below, and on nothing of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import save_checkpoint
from diloco.codec import CodecError
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.init_source import InitElection, decode_upload, upload_problem
from diloco.coordinator.membership import Membership
from diloco.coordinator.parts import PartialPushes
from diloco.coordinator.site_evals import SiteEvals
from diloco.errors import CoordinatorError
from diloco.security.ids import quote, site_id_problem
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec
from diloco.wire import mismatches

JOIN_WAIT_S = 20.0  # init=site: how long a Join waits for θ₀ before it is told to try again


class SiteSessions:
    """Joins, heartbeats and leaves (see the module's docstring)."""

    # The coordinator's, used here (service.Coordinator sets them).
    cfg: CoordinatorConfig
    run_id: str
    init_from: str
    on_init: list[Callable[[str], None]]
    _cv: threading.Condition
    _ready: bool
    _open: int
    _specs: dict[str, TensorSpec]
    _split: tuple[tuple[str, ...], ...]
    _members: Membership
    _election: InitElection
    _left: dict[str, str]
    _parts: PartialPushes
    _site_evals: SiteEvals
    _require_healthy: Callable[[], None]
    _require_member: Callable[[str], None]
    _check_header: Callable[[PushHeader, str], None]
    _status: Callable[[], RoundStatus]
    _install: Callable[[Mapping[str, torch.Tensor], str], None]
    _checkpoint_state: Callable[..., dict[str, Any]]

    def join(self, request: JoinRequest) -> JoinInfo:
        """Admits a site whose model matches θ's fingerprint and whose stated settings are the
        run's; answers with the run's settings. Before θ₀ exists (init=site) the first site that
        can upload becomes its source (``JoinInfo.upload_init``); the others wait here for it,
        up to ``JOIN_WAIT_S``, then are told to try again (unavailable)."""
        site_id, specs, can_upload = request.site_id, list(request.specs), request.can_upload
        why = site_id_problem(site_id)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)
        self._check_settings(site_id, request.stated)
        with self._cv:
            self._require_healthy()
            self._require_admissible(site_id)
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
                    "invalid_argument", f"model of site {site_id!r} does not match the coordinator's (θ₀ from {self.init_from}): " + "; ".join(problems)[:2000]
                )
            self._admit(site_id)
            return self._join_info()

    def _require_admissible(self, site_id: str) -> None:
        """Only the run's configured ids (or, without a list, up to ``max_sites`` ids) may join."""
        if self.cfg.sites is not None and site_id not in self.cfg.sites:
            raise CoordinatorError("permission_denied", f"site {site_id!r} is not one of this run's sites ({', '.join(self.cfg.sites)})")
        known = self._members.known
        if self.cfg.sites is None and self.cfg.max_sites is not None and site_id not in known and len(known) >= self.cfg.max_sites:
            raise CoordinatorError(
                "permission_denied", f"this run has {self.cfg.max_sites} site(s), all taken ({', '.join(sorted(known))}); site {site_id!r} may not join"
            )

    def _admit(self, site_id: str) -> None:
        self._members.join(site_id)
        self._left.pop(site_id, None)
        # A site that (re)joins starts its rounds afresh: parts an earlier incarnation of it
        # pushed must not be combined with the parts of this one.
        self._parts.discard_site(site_id)

    def _join_info(self, upload_init: bool = False) -> JoinInfo:
        settings = self.cfg.settings
        return JoinInfo(
            total_rounds=self.cfg.total_rounds,
            run_id=self.run_id,
            lease_s=self.cfg.quorum.lease_s,
            upload_init=upload_init,
            eval_every=self.cfg.site_eval_every,
            settings=settings.to_dict() if settings is not None else None,
            fragments=self._split if self._ready else (),
        )

    def _check_settings(self, site_id: str, stated: Mapping[str, Any]) -> None:
        """A site that states a run setting must state the run's (a coordinator without settings checks none)."""
        if self.cfg.settings is None or not stated:
            return
        conflicts = self.cfg.settings.conflicts(stated)
        if conflicts:
            shown = "; ".join(conflicts[:8])
            raise CoordinatorError(
                "invalid_argument", f"site {site_id!r} states settings other than this run's: {shown}; use the run's values or leave them unset"
            )

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """θ₀ from the site that Join chose as its source (init=site): every tensor it declared,
        whole, float32, finite, sent lossless; all or nothing. A refused upload leaves θ₀ unset
        and the role to the next site that joins; an accepted one is checkpointed (round 0)
        before any site can pull it, so a restarted coordinator never asks again."""
        self._check_header(header, "upload of θ₀")
        site = header.site_id
        with self._cv:
            self._require_healthy()
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
            # θ₀ is installed and checkpointed under the lock: until it is, no site can push or
            # pull anything, so there is nothing for the lock to hold up.
            self._install(params, f"site {site!r}")
            if self.cfg.checkpoint_dir is not None:
                save_checkpoint(Path(self.cfg.checkpoint_dir), 0, self._checkpoint_state())
            self._cv.notify_all()
        for listener in self.on_init:
            listener(self.init_from)
        return PushResult(accepted=True, duplicate=False, round=0, payload_bytes=payload_bytes)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        if global_sha256 and not (len(global_sha256) == 64 and all(c in "0123456789abcdef" for c in global_sha256)):
            raise CoordinatorError("invalid_argument", f"global_sha256={quote(global_sha256)}: must be empty or 64 lowercase hex digits")
        with self._cv:
            self._require_healthy()
            why = site_id_problem(site_id)
            if why is not None:
                raise CoordinatorError("invalid_argument", why)
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
