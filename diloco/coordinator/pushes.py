"""The coordinator's way in for pseudo-gradients, as calls: a whole push, the parts of a sharded
site's push, and a withheld one (a site with no Δ for the round). Each is checked (header,
membership, round: verdict.py), decoded outside the lock (intake.py), then, under the lock,
counted into the open round (the round book's facts, the shard's sum), merged into it (a late
push under quorum.late=merge), or refused; the push that completes a round commits it and
publishes it once it is durable (``close``, ``publish``: the coordinator's)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diloco.codec import CodecError
from diloco.coordinator.commit import describe_part
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.gate import Gate
from diloco.coordinator.intake import Intake
from diloco.coordinator.round_book import RoundBook
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shards import ShardSet
from diloco.coordinator.verdict import PushFacts, push_verdict
from diloco.errors import CoordinatorError
from diloco.types import Chunk, PushHeader, PushResult
from diloco.wire import check_part, unbundled


class Pushes:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        gate: Gate,
        sessions: Sessions,
        book: RoundBook,
        shard: ShardSet,
        intake: Intake,
        *,
        clock: Callable[[], float],
        close: Callable[[dict[str, Any]], Any],
        publish: Callable[[Any], Any],
        on_push: list[Callable[[int], None]],
    ) -> None:
        """``close(times)``: under the lock, commits the open round if its policy allows (returns
        what ``publish`` takes, outside the lock); ``on_push``: called with the round after each
        accepted push."""
        self.cfg, self.gate, self.sessions, self.book, self.shard, self.intake = cfg, gate, sessions, book, shard, intake
        self._clock, self._close, self._publish, self._on_push = clock, close, publish, on_push

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """Accepts one site's whole pseudo-gradient for one round, or nothing of it. A part of
        a sharded site's push (``header.parts > 1``) waits until every part has arrived."""
        self.intake.check_header(header, "push")
        if header.withheld:
            return self._withhold(header, chunks)
        if header.parts > 1:
            return self._part(header, chunks)
        with self.gate.cv:
            verdict = self._check(header)
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
        with self.gate.cv:
            verdict = self._check(header)
            if verdict == "duplicate":
                return _duplicate(header)
            self._keep_eval(header)
            if verdict == "take":
                weight = self.book.current.withhold(header, self._clock())
                if weight is not None:
                    self.shard.add_zero(weight)
                pending = self._close({"closer": header.site_id, "began_at": at, "first_chunk_s": 0.0, "receive_s": 0.0, "lock_s": 0.0})
        self._after(header, pending)
        return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=0, refused=f"withheld by the site: {header.withheld}")

    def _take(
        self, header: PushHeader, chunks: Iterable[tuple[Chunk, torch.Tensor | None]], sliced: list[dict[str, int]] | None = None, parts_payload: int = 0
    ) -> PushResult:
        """Decodes a whole push (intake), then counts it into the round or merges it.
        ``sliced``: what the parts of a sharded push held (the round's record), ``parts_payload``
        their bytes."""
        check = lambda name: self.shard.check_fragment(header.round, name)  # noqa: E731
        with self.intake.receive(header, chunks, self.shard.round_specs(header.round), check, whole=sliced is None) as got:
            with self.gate.cv:
                # The round may have moved on while we decoded; check again before touching it.
                verdict = self._check(header)
                if verdict == "duplicate":
                    return _duplicate(header)
                self._keep_eval(header)
                judged = self.intake.judge(header.site_id, got.size)
                state, merged_into = self.book.current, 0
                if verdict == "merge":
                    weight = state.merge(header, self.cfg.quorum.late_discount ** (self.book.open - header.round), judged)
                    self.book.merged_done.add((header.site_id, header.round))
                    merged_into = self.book.open
                else:
                    weight = state.take(header, self._clock(), sliced, judged)
                if weight is not None:
                    self.shard.add(got.delta, weight, judged.scale if judged.action == "clip" else None)
                state.bytes_up += got.payload_bytes + parts_payload
                times = {k: v for k, v in got.times.items() if k != "received"}
                # The push's receive and decode (from its first chunk), and the wait for the lock.
                pending = self._close({"closer": header.site_id, **times, "lock_s": time.perf_counter() - got.times["received"]})
        self._after(header, pending)
        return PushResult(
            accepted=True, duplicate=False, round=header.round, payload_bytes=got.payload_bytes, merged_into=merged_into,
            refused=judged.describe() if judged.action == "reject" else "", clipped=judged.describe() if judged.action == "clip" else "",
        )  # fmt: skip

    def _part(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """One rank's slices of a sharded site's push: checked and decoded now, and taken as one
        whole push (the slices must tile every tensor) when the site's last part arrives."""
        what = f"push part {header.part} of {header.parts} of site {header.site_id!r} for round {header.round}"
        with self.gate.cv:
            verdict = self._check(header)
        if verdict == "duplicate":
            return _duplicate(header)
        try:
            specs = self.shard.round_specs(header.round)
            kept, boxes, payload = check_part(specs, (self.shard.check_fragment(header.round, c.name) or c for c in unbundled(chunks)))
        except CodecError as e:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
        parts = self.intake.parts
        with self.gate.cv:
            try:
                verdict = self._check(header)
            except CoordinatorError:
                parts.discard(header.site_id, header.round)  # late and refused: the other parts go too
                raise
            if verdict == "duplicate":
                return _duplicate(header)
            try:
                state, every, every_bytes = parts.add(header, kept, boxes, payload)
            except ValueError as e:
                raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
            if state == "duplicate":
                return _duplicate(header)
            self._keep_eval(header)
        if state == "waiting":
            return PushResult(accepted=True, duplicate=False, round=header.round, payload_bytes=payload)
        described = [describe_part(p, [c for c, _ in part], self.shard.specs) for p, part in every.items()]
        result = self._take(header, (pair for part in every.values() for pair in part), sliced=described, parts_payload=sum(every_bytes.values()))
        return dataclasses.replace(result, payload_bytes=payload)

    def _check(self, header: PushHeader) -> str:
        """Under the lock: "take" (a push for the open round), "merge" (a late push the policy
        folds into the open round) or "duplicate" (a harmless repeat); raises if the push cannot
        be taken. A push for a round that is being committed waits until it is published."""
        self.gate.member(header.site_id)
        self.gate.ready()
        self.gate.published()
        if header.eval is not None:
            self.sessions.check_eval(header.site_id, header.eval, self.book.open)
        site, r, book = header.site_id, header.round, self.book
        facts = PushFacts(
            round=r, open_round=book.open, total_rounds=self.cfg.total_rounds, pushed_this_round=site in book.current.pushes,
            counted_before=book.counted_before(site, r),
        )  # fmt: skip
        verdict = push_verdict(facts, self.cfg.quorum)
        if verdict == "past_end":
            raise CoordinatorError("out_of_range", f"round {r} is past the last round ({self.cfg.total_rounds - 1}) of this run")
        if verdict == "not_open":
            raise CoordinatorError("failed_precondition", f"round {r} is not open (open round is {book.open})")
        if verdict == "late":
            book.note_late(site, r)
            raise CoordinatorError(
                "aborted", f"round {r} was committed without site {site!r} (open round is {book.open}); pull the global parameters and go on"
            )
        return verdict

    def _keep_eval(self, header: PushHeader) -> None:
        """Keeps the evaluation an accepted push carried (checked in ``_check``)."""
        if header.eval is not None:
            self.sessions.evals.add(header.site_id, header.eval)

    def _after(self, header: PushHeader, pending: Any) -> None:
        for listener in self._on_push:
            listener(header.round)
        self._publish(pending)


def _duplicate(header: PushHeader) -> PushResult:
    return PushResult(accepted=False, duplicate=True, round=header.round, payload_bytes=0)
