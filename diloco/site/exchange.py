"""The protocol steps of one round, seen from a site: push Δ, then pull the update, the
coordinator holding the pull until the round is committed. Retries (with backoff) whatever
failed because the coordinator could not be reached, starting again from the push: pushes
are idempotent (a repeat of a counted push is answered "duplicate"), and a coordinator that
restarted from its checkpoint has lost the pushes of its open round."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.boxes import Box
from diloco.errors import RemoteError
from diloco.site.outcome import APPLIED, RoundOutcome, refused_pull, refused_push
from diloco.site.stats import SyncStats
from diloco.transport import CoordinatorClient, PullCall, retrying
from diloco.types import Chunk, PushHeader, PushResult


class Assembler(Protocol):
    payload_bytes: int

    def add(self, chunk: Chunk) -> None: ...

    def finish(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Timeouts:
    wait_poll_s: float = 30.0  # one pull waits at most this long for its round's commit
    round_timeout_s: float = 3600.0  # give up on a round not committed within this
    reconnect_timeout_s: float = 300.0  # give up when the coordinator is unreachable this long


def exchange(
    client: CoordinatorClient,
    pushes: list[tuple[PushHeader, list[Chunk]]],
    pulls: list[dict[str, Box] | None],
    new_assembler: Callable[[], Assembler],
    timeouts: Timeouts,
    stats: SyncStats,
    times: dict[str, float],
    log: Callable[[str], None],
    on_committed: Callable[[], None] | None = None,
) -> tuple[RoundOutcome, Assembler | None]:
    """Push, wait, pull for one round: (APPLIED, the pulled update) or the outcome that catching
    up needs. Adds the seconds of each step to ``times``. ``pushes``: the round's push, or its
    parts (striped: each on its own stream at once); ``pulls``: what each pull stream asks for
    (one entry: a plain pull), into ``new_assembler()`` (a ``StripedPull`` for several).
    ``on_committed`` is called once the round is committed, before the pull."""
    header = pushes[0][0]
    site, r = header.site_id, header.round

    def attempt() -> tuple[RoundOutcome, Assembler | None]:
        early: list[PullCall] = []

        def send_pulls() -> None:
            """The push's last chunk is on its way: the pulls follow it at once, and the
            coordinator holds them until the round closes (no round trip after the push's
            answer). A pull that cannot be sent now is sent after the answer."""
            try:
                for i, want in enumerate(pulls):
                    early.append(client.start_pull(site, r, want, lane=i, wait_s=timeouts.wait_poll_s))
            except (RemoteError, ValueError):
                _cancel(early)
                early.clear()

        try:
            t = time.perf_counter()
            try:
                result = _push_all(client, pushes, then=send_pulls)
            except RemoteError as e:
                outcome = refused_push(e)
                if outcome is None:
                    raise
                return outcome, None
            finally:
                times["push_s"] += time.perf_counter() - t
            stats.bytes_up += result.payload_bytes
            times["bytes_up"] = result.payload_bytes
            if result.refused or result.clipped:
                stats.uncounted[r] = f"{'not counted' if result.refused else 'counted scaled down'}: {result.refused or result.clipped}"
                log(
                    f"site {site}: round {r} push {'not counted' if result.refused else 'counted scaled down'} by the coordinator: {result.refused or result.clipped}"
                )
            applied = RoundOutcome(refused=True) if result.refused else APPLIED
            if result.merged_into:
                # Late, but merged into the open round (quorum.late=merge): it counted; go on from
                # the open round's θ like a site whose push was dropped.
                log(f"site {site}: round {r} push came late; merged into round {result.merged_into}")
                return RoundOutcome(catch_up=True, merged=True), None
            try:
                assembler = new_assembler()
                _wait_and_pull(client, site, r, pulls, assembler, timeouts, times, log, on_committed, started=list(early))
            except RemoteError as e:
                outcome = refused_pull(e)
                if outcome is None:
                    raise
                return outcome, None
            return applied, assembler
        finally:
            _cancel(early)  # unread (the push failed, or came late): the coordinator stops holding them

    return retrying(attempt, limit_s=timeouts.reconnect_timeout_s, what=f"site {site} round {r}", log=log, on_retry=stats.retried)


def _push_all(client: CoordinatorClient, pushes: list[tuple[PushHeader, list[Chunk]]], then: Callable[[], None] | None = None) -> PushResult:
    """The push, or its parts at once, one stream each; one result for them all (the verdict
    comes with the last part in). The first refusal is raised once every stream has ended.
    ``then`` is called (on a gRPC thread) once every stream's last chunk has been sent."""
    left, lock = [len(pushes)], threading.Lock()

    def chunks_then(chunks: list[Chunk]) -> Iterator[Chunk]:
        yield from chunks
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and then is not None:
            then()

    if len(pushes) == 1:
        header, chunks = pushes[0]
        return client.push(header, chunks_then(chunks))
    with ThreadPoolExecutor(max_workers=len(pushes), thread_name_prefix="push-lane") as pool:
        futures = [pool.submit(client.push, header, chunks_then(chunks), lane=i) for i, (header, chunks) in enumerate(pushes)]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except RemoteError as e:
                errors.append(e)
    if errors:
        raise errors[0]
    return PushResult(
        accepted=all(x.accepted or x.duplicate for x in results), duplicate=all(x.duplicate for x in results), round=results[0].round,
        payload_bytes=sum(x.payload_bytes for x in results), merged_into=max(x.merged_into for x in results),
        refused=next((x.refused for x in results if x.refused), ""), clipped=next((x.clipped for x in results if x.clipped), ""),
    )  # fmt: skip


def _wait_and_pull(
    client: CoordinatorClient,
    site: str,
    r: int,
    pulls: list[dict[str, Box] | None],
    assembler: Assembler,
    timeouts: Timeouts,
    times: dict[str, float],
    log: Callable[[str], None],
    on_committed: Callable[[], None] | None,
    started: list[PullCall] | None = None,
) -> None:
    """Round ``r``'s update into ``assembler`` once the round is committed: one stream, or one
    per entry of ``pulls`` at once (``started``: those already sent). Each stream asks the
    coordinator to hold it until the commit (``wait_poll_s`` at a time) and send the update
    right then, so the commit costs no round trip of its own (a separate wait, then a pull,
    cost a whole RTT more per round). ``times``: wait_s until the commit was known, pull_s from
    then on. Raises RemoteError(round_timeout) after ``round_timeout_s``."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeouts.round_timeout_s
    known: list[float] = []
    lock = threading.Lock()

    def committed() -> None:
        with lock:
            if known:
                return
            known.append(time.perf_counter())
        if on_committed is not None:
            on_committed()

    targets: list[Assembler] = [assembler] if len(pulls) == 1 else assembler.parts  # type: ignore[attr-defined]  # a StripedPull
    calls: dict[int, PullCall] = dict(enumerate(started or ()))
    open_lanes = list(range(len(pulls)))
    try:
        while open_lanes:
            wait_s = max(0.001, min(timeouts.wait_poll_s, deadline - time.monotonic()))
            for i in open_lanes:
                if i not in calls:
                    calls[i] = client.start_pull(site, r, pulls[i], lane=i, wait_s=wait_s)
            if len(open_lanes) == 1:
                got = [calls[open_lanes[0]].result(committed)]
            else:  # each read on its own thread: a stream not read stops at its flow-control window
                with ThreadPoolExecutor(max_workers=len(open_lanes), thread_name_prefix="pull-lane") as pool:
                    got = list(pool.map(lambda i: calls[i].result(committed), open_lanes))
            for i, chunks in zip(open_lanes, got):
                for c in chunks or ():
                    targets[i].add(c)
                if chunks is None:
                    del calls[i]
            open_lanes = [i for i, chunks in zip(open_lanes, got) if chunks is None]
            if open_lanes:
                if time.monotonic() >= deadline:
                    raise RemoteError("round_timeout", f"round {r} was not committed within {timeouts.round_timeout_s:.0f}s")
                log(f"site {site}: waiting for round {r} to close")
    finally:
        _cancel(calls.values())  # those not read to the end (another lane failed)
    t1 = time.perf_counter()
    at = min(max(known[0], t0), t1) if known else t1
    times["wait_s"] += at - t0
    times["pull_s"] += t1 - at


def _cancel(calls: Iterable[PullCall]) -> None:
    for c in calls:
        c.cancel()


def assemble(chunks: Iterable[Chunk], assembler: Assembler) -> Assembler:
    for c in chunks:
        assembler.add(c)
    return assembler
