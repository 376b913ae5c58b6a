"""Membership and quorum rounds through the real gRPC server, with a fake clock: silent sites
are evicted and rounds go on without them; a deadline closes a round at the quorum; late and
evicted pushes are refused with a status that says so and change nothing; a rejoin works."""

from collections.abc import Iterator

import pytest
import torch
from helpers import FakeClock

from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.outer import OuterConfig
from diloco.transport import CoordinatorClient, RemoteError, serve
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)


def _theta() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def _serve(cfg: CoordinatorConfig) -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    clock = FakeClock()
    coord = Coordinator(_theta(), OuterConfig(), cfg, clock=clock)
    records = []
    coord.on_commit.append(records.append)
    coord.records = records  # type: ignore[attr-defined]
    server, port = serve(coord, "127.0.0.1", 0)
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=10, connect_timeout_s=10)
    try:
        yield coord, client, clock
    finally:
        client.close()
        server.stop(grace=None).wait(5)


@pytest.fixture
def lease10() -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    yield from _serve(CoordinatorConfig(total_rounds=5, min_sites=1, quorum=QuorumConfig(lease_s=10)))


@pytest.fixture
def deadline30() -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock]]:
    yield from _serve(CoordinatorConfig(total_rounds=5, min_sites=2, quorum=QuorumConfig(lease_s=100, deadline="fixed", deadline_s=30)))


def _push(client: CoordinatorClient, site: str, round: int, value: float = 0.1):
    delta = {"w": torch.full((2, 3), value)}
    header = PushHeader(site_id=site, round=round, tokens=10, train_loss=1.0, inner_steps=1)
    return client.push(header, encode_chunks(delta, codec=get_codec("fp32")))


def _join(client: CoordinatorClient, *sites: str) -> None:
    for s in sites:
        info = client.join(JoinRequest(s, tuple(fingerprint(_theta()).values())))
        assert info.lease_s > 0


def test_a_silent_site_is_evicted_and_the_round_goes_on(lease10) -> None:
    coord, client, clock = lease10
    _join(client, "a", "b")
    assert _push(client, "a", 0).accepted
    clock.t += 6
    client.heartbeat("a")  # a stays; b has been silent since it joined
    assert coord.tick() is None  # b's lease has 4 s left: the round still waits for it
    clock.t += 5
    record = coord.tick()
    assert record is not None and record.participants == ["a"] and coord.active_sites == {"a"}
    before = coord.global_sha256()
    with pytest.raises(RemoteError) as info:
        _push(client, "b", 0)
    assert info.value.kind == "failed_precondition" and "'b' was evicted: no heartbeat for 10 s" in info.value.message
    with pytest.raises(RemoteError, match="evicted"):
        client.heartbeat("b")
    assert coord.global_sha256() == before
    # b joins again, pulls θ whole at the open round and takes part in it.
    _join(client, "b")
    status, _chunks = client.pull_global("b")
    assert status.committed_rounds == 1
    assert _push(client, "a", 1).accepted and coord.committed_rounds == 1
    assert _push(client, "b", 1).accepted and coord.committed_rounds == 2
    assert coord.records[-1].participants == ["a", "b"]


def test_a_deadline_closes_the_round_at_the_quorum_and_refuses_the_late_push(deadline30) -> None:
    coord, client, clock = deadline30
    _join(client, "a", "b", "c")
    assert _push(client, "a", 0).accepted
    clock.t += 20
    assert coord.tick() is None  # before the deadline, and c is active
    assert _push(client, "b", 0).accepted and coord.committed_rounds == 0
    clock.t += 10
    record = coord.tick()
    assert record is not None and record.participants == ["a", "b"] and record.tokens == 20
    before = coord.global_sha256()
    with pytest.raises(RemoteError) as info:
        _push(client, "c", 0)  # late: the round was committed without it
    assert info.value.kind == "aborted"
    assert "round 0 was committed without site 'c'" in info.value.message and "pull the global parameters" in info.value.message
    assert coord.global_sha256() == before and coord.committed_rounds == 1
    # A repeated push of a participant is still a harmless duplicate.
    assert _push(client, "a", 0).duplicate
    # c is still a member: it pulls θ and takes part in round 1.
    assert client.pull_global("c")[0].committed_rounds == 1
    assert _push(client, "c", 1).accepted


def test_below_the_quorum_a_deadline_does_not_close_the_round(deadline30) -> None:
    coord, client, clock = deadline30
    _join(client, "a", "b")
    assert _push(client, "a", 0).accepted
    clock.t += 99
    client.heartbeat("b")
    assert coord.tick() is None and coord.committed_rounds == 0  # 1 push < min_sites 2
    assert _push(client, "b", 0).accepted and coord.committed_rounds == 1


def _site_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(_theta()["w"].clone())
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
