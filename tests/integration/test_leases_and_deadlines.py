"""Membership and quorum rounds through the real gRPC server, with a fake clock: silent sites
are evicted and rounds go on without them; a deadline closes a round at the quorum; late and
evicted pushes are refused with a status that says so and change nothing; a rejoin works."""

from collections.abc import Iterator

import pytest
import torch
from helpers import FakeClock, coordinator, filled, join, push, served_client, theta

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.transport import CoordinatorClient, RemoteError

pytestmark = pytest.mark.timeout(60)
THETA = theta({"w": (2, 3)})
DELTA = filled(THETA, 0.1)


def _serve(cfg: CoordinatorConfig) -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    clock = FakeClock()
    coord = coordinator(THETA, cfg, clock=clock)
    records = []
    coord.on_commit.append(records.append)
    coord.records = records  # type: ignore[attr-defined]
    with served_client(coord) as client:
        yield coord, client, clock


@pytest.fixture
def lease10() -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    yield from _serve(CoordinatorConfig(total_rounds=5, min_sites=1, quorum=QuorumConfig(lease_s=10)))


@pytest.fixture
def deadline30() -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    yield from _serve(CoordinatorConfig(total_rounds=5, min_sites=2, quorum=QuorumConfig(lease_s=100, deadline="fixed", deadline_s=30)))


def _join_with_a_lease(client: CoordinatorClient, *sites: str) -> None:
    for info in join(client, THETA, *sites):
        assert info.lease_s > 0


def test_a_silent_site_is_evicted_and_the_round_goes_on(lease10) -> None:
    coord, client, clock = lease10
    _join_with_a_lease(client, "a", "b")
    assert push(client, "a", 0, DELTA).accepted
    clock.t += 6
    client.heartbeat("a")  # a stays; b has been silent since it joined
    assert coord.tick() is None  # b's lease has 4 s left: the round still waits for it
    clock.t += 5
    record = coord.tick()
    assert record is not None and record.participants == ["a"] and coord.active_sites == {"a"}
    before = coord.global_sha256()
    with pytest.raises(RemoteError) as info:
        push(client, "b", 0, DELTA)
    assert info.value.kind == "failed_precondition" and "'b' was evicted: no heartbeat for 10 s" in info.value.message
    with pytest.raises(RemoteError, match="evicted"):
        client.heartbeat("b")
    assert coord.global_sha256() == before
    # b joins again, pulls θ whole at the open round and takes part in it.
    _join_with_a_lease(client, "b")
    status, _chunks = client.pull_global("b")
    assert status.committed_rounds == 1
    assert push(client, "a", 1, DELTA).accepted and coord.committed_rounds == 1
    assert push(client, "b", 1, DELTA).accepted and coord.committed_rounds == 2
    assert coord.records[-1].participants == ["a", "b"]


def test_a_deadline_closes_the_round_at_the_quorum_and_refuses_the_late_push(deadline30) -> None:
    coord, client, clock = deadline30
    _join_with_a_lease(client, "a", "b", "c")
    assert push(client, "a", 0, DELTA).accepted
    clock.t += 20
    assert coord.tick() is None  # before the deadline, and c is active
    assert push(client, "b", 0, DELTA).accepted and coord.committed_rounds == 0
    clock.t += 10
    record = coord.tick()
    assert record is not None and record.participants == ["a", "b"] and record.tokens == 20
    before = coord.global_sha256()
    with pytest.raises(RemoteError) as info:
        push(client, "c", 0, DELTA)  # late: the round was committed without it
    assert info.value.kind == "aborted"
    assert "round 0 was committed without site 'c'" in info.value.message and "pull the global parameters" in info.value.message
    assert coord.global_sha256() == before and coord.committed_rounds == 1
    # A repeated push of a participant is still a harmless duplicate.
    assert push(client, "a", 0, DELTA).duplicate
    # c is still a member: it pulls θ and takes part in round 1.
    assert client.pull_global("c")[0].committed_rounds == 1
    assert push(client, "c", 1, DELTA).accepted


def test_below_the_quorum_a_deadline_does_not_close_the_round(deadline30) -> None:
    coord, client, clock = deadline30
    _join_with_a_lease(client, "a", "b")
    assert push(client, "a", 0, DELTA).accepted
    clock.t += 99
    client.heartbeat("b")
    assert coord.tick() is None and coord.committed_rounds == 0  # 1 push < min_sites 2
    assert push(client, "b", 0, DELTA).accepted and coord.committed_rounds == 1


def _site_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(THETA["w"].clone())
    return model


def test_a_site_whose_push_came_too_late_or_was_evicted_catches_up(deadline30) -> None:
    """OuterSync drops the round's work, pulls θ whole (joining again when evicted) and goes on."""
    import threading

    from diloco.site.outer_sync import OuterSync

    coord, client, clock = deadline30
    sites = {s: OuterSync(_site_model(), client, s) for s in ("a", "b", "c")}
    try:
        for s in sites.values():
            s.join()
        for s in sites.values():
            with torch.no_grad():
                s.model.w.sub_(0.5)  # some local training
        waiting = [threading.Thread(target=sites[s].sync, kwargs=dict(tokens=10, train_loss=1.0, inner_steps=1)) for s in ("a", "b")]
        for t in waiting:
            t.start()
        while len(coord.book.current.pushed_at) < 2:  # wait until both pushes are in
            threading.Event().wait(0.05)
        clock.t += 31
        assert coord.tick() is not None
        for t in waiting:
            t.join(10)
        late = sites["c"]
        digest = late.sync(tokens=10, train_loss=1.0, inner_steps=1)
        assert late.stats.dropped_rounds == [0] and late.round == 1 and late.stats.rejoins == 0
        assert digest == coord.global_sha256() == sites["a"].global_sha256()
        assert torch.equal(late.layout.model.w.detach(), coord.global_params()["w"])
        # Evicted: c falls silent past its lease (its heartbeats stop), then pushes round 1.
        late.close()
        clock.t += 101
        coord.tick()
        assert "c" not in coord.active_sites
        digest = late.sync(tokens=10, train_loss=1.0, inner_steps=1)
        assert late.stats.rejoins == 1 and late.stats.dropped_rounds == [0, 1] and late.round == 1
        assert digest == coord.global_sha256() and "c" in coord.active_sites
    finally:
        for s in sites.values():
            s.close()
