"""The coordinator's way in for pseudo-gradients: a whole push, the parts of a sharded site's
push, and a withheld one (a site with no Δ for the round). Each is checked (header, membership,
round), decoded outside the lock into a staging buffer, then added to the open round, merged
into it (a late push under quorum.late=merge), or refused; the push that completes a round
commits it (service.Coordinator._maybe_commit) and publishes it once it is durable.

``PushIntake`` is a part of ``Coordinator`` (a mixin): it works on the coordinator's lock,
open round and policies, declared below, and on nothing of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diloco.codec import CodecError
from diloco.coordinator.commit import describe_part
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.headers import HeaderBounds, header_problem
from diloco.coordinator.parts import PartialPushes
from diloco.coordinator.round_state import RoundState
from diloco.coordinator.site_evals import SiteEvals
from diloco.coordinator.staging import StagingPool
from diloco.coordinator.verdict import PushFacts, push_verdict
from diloco.errors import CoordinatorError
from diloco.outer import NormBound, NormVerdict
from diloco.outer.robust import judged_size
from diloco.types import Chunk, PushHeader, PushResult, SiteEval, TensorSpec
from diloco.wire import ChunkAssembler, check_part, unbundled


class PushIntake:
    """Pushes into the open round (see the module's docstring)."""

    # The coordinator's, used here (service.Coordinator sets them).
    cfg: CoordinatorConfig
    _cv: threading.Condition
    _round: RoundState
    _open: int
    _participants: dict[int, list[str]]
    _merged_done: set[tuple[str, int]]
    _late: dict[int, list[dict[str, Any]]]
    _refusals: dict[str, int]
    _bound: NormBound
    _bounds: HeaderBounds
    _parts: PartialPushes
    _staging: StagingPool
    _site_evals: SiteEvals
    _specs: dict[str, TensorSpec]
    on_push: list[Callable[[int], None]]
    _require_member: Callable[[str], None]
    _require_ready: Callable[[], None]
    _wait_published: Callable[[], None]
    _check_eval: Callable[[str, SiteEval], None]
    _check_fragment: Callable[[int, str], None]
    _round_specs: Callable[[int], dict[str, TensorSpec]]
    _clock: Callable[[], float]
    _maybe_commit: Callable[..., Any]
    _publish: Callable[[Any], Any]

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """Accepts one site's whole pseudo-gradient for one round, or nothing of it. A part of
        a sharded site's push (``header.parts > 1``) waits until every part has arrived."""
        self._check_header(header, "push")
        if header.withheld:
            return self._withhold(header, chunks)
        if header.parts > 1:
            return self._push_part(header, chunks)
        with self._cv:
            verdict = self._check_push(header)
        if verdict == "duplicate":
            return _duplicate(header)
        return self._take(header, ((c, None) for c in unbundled(chunks)))

    def _withhold(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """A site that has no Δ for this round says so (``header.withheld``: why) and sends no
        chunk: the round takes that as the site's part (it stops waiting for the site, counts
        nothing of it, and closes as its policy says). A late one has nothing to merge."""
        at = time.monotonic()
        what = f"push of site {header.site_id!r} for round {header.round}"
        try:
            extra = next(iter(unbundled(chunks)), None)
        except CodecError as e:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
        if extra is not None:
            raise CoordinatorError("invalid_argument", f"{what} rejected: it is withheld ({header.withheld!r}) yet carries chunks")
        pending = None
        with self._cv:
            verdict = self._check_push(header)
            if verdict == "duplicate":
                return _duplicate(header)
            self._record_eval(header)
            if verdict == "take":
                self._round.withhold(header, self._clock())
                pending = self._maybe_commit({"closer": header.site_id, "began_at": at, "first_chunk_s": 0.0, "receive_s": 0.0, "lock_s": 0.0})
        for push_listener in self.on_push:
            push_listener(header.round)
        self._publish(pending)
        return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=0, refused=f"withheld by the site: {header.withheld}")

    def _take(
        self, header: PushHeader, chunks: Iterable[tuple[Chunk, torch.Tensor | None]], sliced: list[dict[str, int]] | None = None, parts_payload: int = 0
    ) -> PushResult:
        """Decodes a whole push into a staging buffer, then adds it to the round (or merges it).
        ``chunks``: each with its values when they were decoded already (the parts of a sharded
        push: ``sliced`` is what they held, for the round's record, ``parts_payload`` their bytes).

        A buffer is taken only once the first chunk is here, and a site decodes one push at a
        time: a client that stalls holds at most one buffer, until its stream's idle deadline."""
        t0, at = time.perf_counter(), time.monotonic()
        chunks = iter(chunks)
        try:
            first = next(chunks, None)
        except CodecError as e:  # a bundle that does not parse
            raise CoordinatorError("invalid_argument", f"push of site {header.site_id!r} for round {header.round} rejected: {e}") from None
        t_first = time.perf_counter()
        with self._staging.take(header.site_id) as staging:
            assembler = ChunkAssembler(self._round_specs(header.round), out=staging)
            try:
                for chunk, values in itertools.chain([first] if first is not None else [], chunks):
                    self._check_fragment(header.round, chunk.name)
                    assembler.add(chunk, values)
                delta = assembler.finish()
            except CodecError as e:
                raise CoordinatorError("invalid_argument", f"push of site {header.site_id!r} for round {header.round} rejected: {e}") from None
            payload = assembler.payload_bytes + parts_payload
            size = judged_size(delta, self.cfg.robust)
            received = time.perf_counter()
            with self._cv:
                # The round may have moved on while we decoded; check again before touching it.
                verdict = self._check_push(header)
                if verdict == "duplicate":
                    return _duplicate(header)
                self._record_eval(header)
                judged = self._judge(header.site_id, size)
                merged_into = 0
                if verdict == "merge":
                    self._round.merge(header, delta, self.cfg.quorum.late_discount ** (self._open - header.round), judged)
                    self._merged_done.add((header.site_id, header.round))
                    merged_into = self._open
                else:
                    self._round.take(header, delta, self._clock(), sliced, judged)
                self._round.bytes_up += payload
                # The push's receive and decode (from its first chunk), and the wait for the lock.
                pending = self._maybe_commit(
                    {
                        "closer": header.site_id,
                        "began_at": at,
                        "first_chunk_s": t_first - t0,
                        "receive_s": received - t0,
                        "lock_s": time.perf_counter() - received,
                    }
                )
        for push_listener in self.on_push:
            push_listener(header.round)
        self._publish(pending)
        return PushResult(
            accepted=True, duplicate=False, round=header.round, payload_bytes=assembler.payload_bytes, merged_into=merged_into,
            refused=judged.describe() if judged.action == "reject" else "", clipped=judged.describe() if judged.action == "clip" else "",
        )  # fmt: skip

    def _judge(self, site_id: str, size: float) -> NormVerdict:
        """Under the lock: robust.norm_ratio's verdict on a push's Δ norm (a non-finite norm is
        always refused); the norm it is counted with joins the reference."""
        judged = self._bound.judge(size)
        if judged.taken_norm is not None:
            self._bound.record(judged.taken_norm)
        if judged.action == "reject":
            self._refusals[site_id] = self._refusals.get(site_id, 0) + 1
        return judged

    def _push_part(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """One rank's slices of a sharded site's push: checked and decoded now, and taken as one
        whole push (the slices must tile every tensor) when the site's last part arrives."""
        what = f"push part {header.part} of {header.parts} of site {header.site_id!r} for round {header.round}"
        with self._cv:
            verdict = self._check_push(header)
        if verdict == "duplicate":
            return _duplicate(header)
        try:
            kept, boxes, payload = check_part(self._round_specs(header.round), (self._check_fragment(header.round, c.name) or c for c in unbundled(chunks)))
        except CodecError as e:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
        with self._cv:
            try:
                verdict = self._check_push(header)
            except CoordinatorError:
                self._parts.discard(header.site_id, header.round)  # late and refused: the other parts go too
                raise
            if verdict == "duplicate":
                return _duplicate(header)
            try:
                state, every, every_bytes = self._parts.add(header, kept, boxes, payload)
            except ValueError as e:
                raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
            if state == "duplicate":
                return _duplicate(header)
            self._record_eval(header)
        if state == "waiting":
            return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=payload)
        described = [describe_part(p, [c for c, _ in part], self._specs) for p, part in every.items()]
        result = self._take(header, (pair for part in every.values() for pair in part), sliced=described, parts_payload=sum(every_bytes.values()))
        return dataclasses.replace(result, payload_bytes=payload)

    def _check_header(self, header: PushHeader, what: str) -> None:
        why = header_problem(header, self._bounds)
        if why is not None:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {why}")

    def _check_push(self, header: PushHeader) -> str:
        """ "take" (a push for the open round), "merge" (a late push the policy folds into the
        open round) or "duplicate" (a harmless repeat); raises if the push cannot be taken.
        A push for a round that is being committed waits until it is published."""
        self._require_member(header.site_id)
        self._require_ready()
        self._wait_published()
        if header.eval is not None:
            self._check_eval(header.site_id, header.eval)
        site, r = header.site_id, header.round
        facts = PushFacts(
            round=r, open_round=self._open, total_rounds=self.cfg.total_rounds, pushed_this_round=site in self._round.pushes,
            counted_before=site in self._participants.get(r, ()) or (site, r) in self._merged_done,
        )  # fmt: skip
        verdict = push_verdict(facts, self.cfg.quorum)
        if verdict == "past_end":
            raise CoordinatorError("out_of_range", f"round {r} is past the last round ({self.cfg.total_rounds - 1}) of this run")
        if verdict == "not_open":
            raise CoordinatorError("failed_precondition", f"round {r} is not open (open round is {self._open})")
        if verdict == "late":
            late = self._late.setdefault(self._open, [])
            if {"site": site, "round": r} not in late:
                late.append({"site": site, "round": r})
            raise CoordinatorError(
                "aborted", f"round {r} was committed without site {site!r} (open round is {self._open}); pull the global parameters and go on"
            )
        return verdict

    def _record_eval(self, header: PushHeader) -> None:
        """Keeps the evaluation an accepted push carried (checked in _check_push)."""
        if header.eval is not None:
            self._site_evals.add(header.site_id, header.eval)


def _duplicate(header: PushHeader) -> PushResult:
    return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
