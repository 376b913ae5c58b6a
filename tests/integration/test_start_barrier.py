"""A fresh run's start barrier through the real gRPC server: the first pulls of θ₀ wait until
every site of the run has pulled, then round 0 opens for all at once; a site that never comes
holds the others only ``quorum.start_wait_s``; a restored run and an unknown number of sites
have no barrier; a pull held too long is told to pull again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from diloco.coordinator import Coordinator, CoordinatorConfig, pulls
from diloco.coordinator.round_policy import QuorumConfig
from diloco.coordinator.start_barrier import StartBarrier
from diloco.outer import OuterConfig
from diloco.transport import CoordinatorClient, RemoteError, serve
from diloco.types import JoinRequest
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

THETA = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def _served(**kw) -> Iterator[tuple[Coordinator, CoordinatorClient]]:
    coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=3, **kw))
    server, port = serve(coord, "127.0.0.1", 0)
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30, connect_timeout_s=10)
    try:
        yield coord, client
    finally:
        client.close()
        server.stop(grace=None).wait(5)


@pytest.fixture
def three() -> Iterator[tuple[Coordinator, CoordinatorClient]]:
    yield from _served(min_sites=2, sites=("a", "b", "c"), quorum=QuorumConfig(start_wait_s=30))


def _pull_in_thread(client: CoordinatorClient, site: str, done: dict[str, float]) -> threading.Thread:
    def pull() -> None:
        client.pull_global(site)
        done[site] = time.monotonic()

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    return t


def _join(client: CoordinatorClient, *sites: str) -> None:
    for s in sites:
        client.join(JoinRequest(s, tuple(fingerprint(THETA).values())))


def test_the_first_pulls_wait_for_every_site_then_round_0_opens(three) -> None:
    coord, client = three
    _join(client, "a", "b", "c")
    done: dict[str, float] = {}
    early = [_pull_in_thread(client, s, done) for s in ("a", "b")]
    time.sleep(0.8)
    assert done == {}, "a and b were let go before c pulled"
    before_c = time.monotonic()
    client.pull_global("c")
    for t in early:
        t.join(10)
    assert set(done) == {"a", "b"} and all(t >= before_c for t in done.values()), done
    assert coord.book.current.opened_at >= before_c - 0.01  # round 0 opened when the last site came in
    # Past the start, pulls are never held (a restarted site pulls at once).
    t0 = time.monotonic()
    client.pull_global("a")
    assert time.monotonic() - t0 < 5


def test_a_site_that_never_comes_holds_the_others_only_start_wait_s() -> None:
    for coord, client in _served(min_sites=1, sites=("a", "b"), quorum=QuorumConfig(start_wait_s=1.0)):
        _join(client, "a")
        t0 = time.monotonic()
        client.pull_global("a")
        waited = time.monotonic() - t0
        assert 0.9 <= waited < 10, waited
        assert coord.sessions.barrier.open and coord.sessions.barrier.arrived == {"a"}


def test_a_pull_held_longer_than_the_hold_is_told_to_pull_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulls, "START_HOLD_S", 0.3)
    for _, client in _served(min_sites=1, sites=("a", "b"), quorum=QuorumConfig(start_wait_s=30)):
        _join(client, "a")
        with pytest.raises(RemoteError) as info:
            client.pull_global("a")
        assert info.value.kind == "unavailable" and info.value.retryable
        assert "every site has pulled θ₀: 1 of 2 site(s) in (a)" in info.value.message


@pytest.mark.parametrize("kw", [{"min_sites": 1}, {"min_sites": 1, "sites": ("a", "b"), "quorum": QuorumConfig(start_wait_s=0)}], ids=["sites unknown", "off"])
def test_no_barrier_without_a_known_number_of_sites_or_when_off(kw) -> None:
    for _, client in _served(**kw):
        _join(client, "a")
        t0 = time.monotonic()
        client.pull_global("a")
        assert time.monotonic() - t0 < 5


def test_a_restored_run_has_no_barrier() -> None:
    for coord, client in _served(min_sites=1, sites=("a", "b"), quorum=QuorumConfig(start_wait_s=30)):
        coord.restore(coord._checkpoint_state())
        _join(client, "a")
        t0 = time.monotonic()
        client.pull_global("a")
        assert time.monotonic() - t0 < 5


def test_the_barrier_opens_once_on_all_sites_or_at_its_time() -> None:
    b = StartBarrier(expected=2, wait_s=10)
    assert not b.open and not b.release(0.0)  # nobody yet: nothing to open
    b.arrive("a", 100.0)
    b.arrive("a", 101.0)  # a second rank of the same site counts once
    assert not b.release(105.0) and b.waiting_for() == "1 of 2 site(s) in (a)"
    assert b.release(110.0) and b.open and not b.release(111.0)  # opened by time, once
    both = StartBarrier(expected=2, wait_s=10)
    both.arrive("b", 0.0)
    both.arrive("a", 1.0)
    assert both.release(1.0)
    assert StartBarrier(expected=None, wait_s=10).open and StartBarrier(expected=3, wait_s=0).open
