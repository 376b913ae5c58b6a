"""The protocol steps of one round, seen from a site: push Δ, wait for the commit, pull the
update. Retries (with backoff) whatever failed because the coordinator could not be reached,
starting again from the push: pushes are idempotent (a repeat of a counted push is answered
"duplicate"), and a coordinator that restarted from its checkpoint has lost the pushes of
its open round."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.boxes import Box
from diloco.errors import RemoteError
from diloco.site.outcome import APPLIED, RoundOutcome, refused_pull, refused_push
from diloco.site.stats import SyncStats
from diloco.transport import CoordinatorClient, retrying
from diloco.types import Chunk, PushHeader, PushResult


class Assembler(Protocol):
    payload_bytes: int

    def add(self, chunk: Chunk) -> None: ...

    def finish(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Timeouts:
    wait_poll_s: float = 30.0  # one WaitRound call waits at most this long
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
        t = time.perf_counter()
        try:
            result = _push_all(client, pushes)
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
            log(f"site {site}: round {r} push {'not counted' if result.refused else 'counted scaled down'} by the coordinator: {result.refused or result.clipped}")
        applied = RoundOutcome(refused=True) if result.refused else APPLIED
        if result.merged_into:
            # Late, but merged into the open round (quorum.late=merge): it counted; go on from
            # the open round's θ like a site whose push was dropped.
            log(f"site {site}: round {r} push came late; merged into round {result.merged_into}")
            return RoundOutcome(catch_up=True, merged=True), None
        try:
            t = time.perf_counter()
            wait_committed(client, site, r, timeouts, log)
            times["wait_s"] += time.perf_counter() - t
            if on_committed is not None:
                on_committed()
            t = time.perf_counter()
            assembler = new_assembler()
            _pull_all(client, site, r, pulls, assembler)
            times["pull_s"] += time.perf_counter() - t
        except RemoteError as e:
            outcome = refused_pull(e)
            if outcome is None:
                raise
            return outcome, None
        return applied, assembler

    return retrying(attempt, limit_s=timeouts.reconnect_timeout_s, what=f"site {site} round {r}", log=log, on_retry=stats.retried)


def _push_all(client: CoordinatorClient, pushes: list[tuple[PushHeader, list[Chunk]]]) -> PushResult:
    """The push, or its parts at once, one stream each; one result for them all (the verdict
    comes with the last part in). The first refusal is raised once every stream has ended."""
    if len(pushes) == 1:
        header, chunks = pushes[0]
        return client.push(header, iter(chunks))
    with ThreadPoolExecutor(max_workers=len(pushes), thread_name_prefix="push-lane") as pool:
        futures = [pool.submit(client.push, header, iter(chunks), lane=i) for i, (header, chunks) in enumerate(pushes)]
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


def _pull_all(client: CoordinatorClient, site: str, r: int, pulls: list[dict[str, Box] | None], assembler: Assembler) -> None:
    """The round's update into ``assembler``: one stream, or one per entry of ``pulls`` at once."""
    if len(pulls) == 1:
        for c in client.pull_update(site, r, pulls[0]):
            assembler.add(c)
        return
    parts = assembler.parts  # type: ignore[attr-defined]  # a StripedPull
    with ThreadPoolExecutor(max_workers=len(pulls), thread_name_prefix="pull-lane") as pool:
        futures = [pool.submit(client.pull_update, site, r, want, lane=i) for i, want in enumerate(pulls)]
        for part, f in zip(parts, futures):
            for c in f.result():
                part.add(c)


def wait_committed(client: CoordinatorClient, site: str, r: int, timeouts: Timeouts, log: Callable[[str], None]) -> None:
    """Returns once round ``r`` is committed; RemoteError(round_timeout) after round_timeout_s."""
    deadline = time.monotonic() + timeouts.round_timeout_s
    while True:
        status = client.wait_round(site, r, max(0.0, min(timeouts.wait_poll_s, deadline - time.monotonic())))
        if status.committed_rounds > r:
            return
        if time.monotonic() >= deadline:
            raise RemoteError("round_timeout", f"round {r} was not committed within {timeouts.round_timeout_s:.0f}s")
        log(f"site {site}: waiting for round {r} to close")


def assemble(chunks: Iterable[Chunk], assembler: Assembler) -> Assembler:
    for c in chunks:
        assembler.add(c)
    return assembler
