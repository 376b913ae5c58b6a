"""What a hostile (or broken) client tried against the coordinator, each now a regression test
through real gRPC on 127.0.0.1: a push that overflowed the outer step, streams that hold
threads and staging buffers, ids that were never configured, header fields out of range.
Every refusal leaves θ as it was, and the run goes on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import expect_refused
from helpers import small_theta as _theta

from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.outer import OuterConfig
from diloco.transport import CoordinatorClient, RemoteError, ServerLimits, serve
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.serde import chunk_to_proto
from diloco.types import Chunk, JoinRequest, PushHeader, TensorSpec
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)
FP32 = get_codec("fp32")


class Served:
    def __init__(self, cfg: CoordinatorConfig, limits: ServerLimits | None = None, theta: dict[str, torch.Tensor] | None = None) -> None:
        self.theta = theta if theta is not None else _theta()
        self.coord = Coordinator(self.theta, OuterConfig(), cfg)
        self.server, self.port = serve(self.coord, "127.0.0.1", 0, limits=limits)
        self.address = f"127.0.0.1:{self.port}"
        self.client = CoordinatorClient(self.address, timeout_s=20, connect_timeout_s=10)
        self.stop_ticker = self.coord.start_ticker(0.05)

    def close(self) -> None:
        self.stop_ticker()
        self.client.close()
        self.server.stop(grace=None).wait(5)

    def join(self, *sites: str) -> None:
        for s in sites:
            self.client.join(JoinRequest(s, tuple(fingerprint(self.theta).values())))

    def push(self, site: str, round: int, value: float = 0.1, tokens: int = 10, **header: object):
        delta = {n: torch.full_like(t, value) for n, t in self.theta.items()}
        header.setdefault("inner_steps", 1)
        h = PushHeader(site_id=site, round=round, tokens=tokens, train_loss=1.0, **header)  # type: ignore[arg-type]
        return self.client.push(h, encode_chunks(delta, codec=FP32))


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(CoordinatorConfig(total_rounds=4, min_sites=2, max_sites=2))
    try:
        yield s
    finally:
        s.close()


def _refused(fn, kind: str, *fragments: str) -> RemoteError:
    return expect_refused(fn, kind, says=fragments)


@pytest.mark.parametrize("value", [3e38, 1e30], ids=["overflows", "absurd"])
def test_a_push_with_huge_finite_values_rejects_its_round_and_the_run_goes_on(served: Served, value: float) -> None:
    """It wedged the coordinator: the outer step overflowed, the re-encoding raised, the
    closing push got UNKNOWN and the ticker died. Now the round is rejected (θ, momentum and
    residual unchanged), every site is answered, and the next round commits."""
    records = []
    served.coord.on_commit.append(records.append)
    served.join("a", "b")
    before = served.coord.global_params()
    assert served.push("a", 0, value=value, tokens=2**40).accepted
    assert served.push("b", 0).accepted  # closes the round: answered normally
    assert served.client.wait_round("a", 0, timeout_s=10).committed_rounds == 1
    assert records[0].rejected and ("not finite" in records[0].guard or "over 100 x" in records[0].guard), records[0].guard
    assert all(torch.equal(before[n], p) for n, p in served.coord.global_params().items())
    assert served.push("a", 1).accepted and served.push("b", 1).accepted
    assert served.client.wait_round("a", 1, timeout_s=10).committed_rounds == 2
    assert not records[1].rejected
    assert served.coord.failed is None
    assert any(t.name == "coordinator-ticker" for t in threading.enumerate())


def test_a_third_site_id_is_refused_in_a_two_site_run(served: Served) -> None:
    served.join("a", "b")
    _refused(lambda: served.join("c"), "permission_denied", "2 site(s)")
    served.push("a", 0)
    served.push("b", 0)
    assert served.coord.committed_rounds == 1  # "c" held nothing open


@pytest.mark.parametrize("site_id", ["x" * 10_000, "../etc", "a\nb", "a\x00b", "", " a", "-a", "a/b"])
def test_a_site_id_that_is_not_a_short_printable_name_is_refused(served: Served, site_id: str) -> None:
    err = _refused(lambda: served.join(site_id), "invalid_argument", "site id", "1-63 characters")
    assert len(err.message) < 300  # the id is quoted cut short


def _header_refused(served: Served, fragment: str, **header: object) -> None:
    before = served.coord.global_sha256()
    fields = {"site": "a", "round": 0, "tokens": 10, **header}
    _refused(lambda: served.push(str(fields.pop("site")), int(fields.pop("round")), tokens=int(fields.pop("tokens")), **fields), "invalid_argument", fragment)
    assert served.coord.global_sha256() == before


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ({"tokens": 2**62}, "tokens=4611686018427387904"),
        ({"tokens": 0}, "tokens=0"),
        ({"tokens": -5}, "tokens=-5"),
        ({"part": -1, "parts": 1}, "part=-1"),
        ({"part": 0, "parts": -3}, "parts=-3"),
        ({"part": 5, "parts": 2}, "part=5"),
        ({"inner_steps": -1}, "inner_steps=-1"),
        ({"round": -1}, "round=-1"),
        ({"round": -2}, "round=-2"),
    ],
)
def test_every_header_field_is_checked(served: Served, header: dict[str, object], fragment: str) -> None:
    served.join("a", "b")
    _header_refused(served, fragment, **header)
    # Nothing counted: the round still waits for both sites.
    served.push("a", 0)
    served.push("b", 0)
    assert served.coord.committed_rounds == 1


def test_a_push_for_round_minus_one_is_not_merged_as_late_work() -> None:
    """Under quorum.late=merge a push for round −1 was merged into the open round (extra weight
    for the sender); under drop it was answered "committed without site …"."""
    for late in ("merge", "drop"):
        s = Served(CoordinatorConfig(total_rounds=4, min_sites=1, quorum=QuorumConfig(late=late)))
        try:
            s.join("a")
            s.push("a", 0)
            _refused(lambda: s.push("a", -1), "invalid_argument", "round=-1")  # noqa: B023 - called at once
            assert s.coord.recent_records()[0]["merged"] == []
        finally:
            s.close()


def test_a_chunk_payload_over_one_mib_is_refused() -> None:
    theta = {"big.w": torch.zeros(600, 500)}  # 300,000 floats: 1.2 MB as one fp32 payload
    s = Served(CoordinatorConfig(total_rounds=2, min_sites=1), theta=theta)
    try:
        s.join("a")
        payload = FP32.encode(torch.full((300_000,), 0.1))
        chunk = Chunk(name="big.w", shape=(600, 500), dtype="float32", offset=0, numel=300_000, codec="fp32", payload=payload)
        header = PushHeader(site_id="a", round=0, tokens=10, train_loss=1.0, inner_steps=1)
        _refused(lambda: s.client.push(header, [chunk]), "invalid_argument", "1048576")
        assert s.coord.committed_rounds == 0
    finally:
        s.close()


def test_waits_for_far_future_rounds_are_refused_at_once(served: Served) -> None:
    served.join("a")
    _refused(lambda: served.client.wait_round("a", 10**9, timeout_s=30), "out_of_range", "rounds are 0..3")
    _refused(lambda: served.client.wait_round("a", -4, timeout_s=30), "out_of_range")


def test_error_messages_quote_client_input_cut_short(served: Served) -> None:
    served.join("a")
    specs = [TensorSpec(name="z" * 20_000, shape=(3,), dtype="float32")] * 50
    err = _refused(lambda: served.client.join(JoinRequest("a", tuple(specs))), "invalid_argument", "does not match")
    assert len(err.message) < 2500
    err = _refused(lambda: served.client.leave("a", "f" * 100_000), "invalid_argument", "global_sha256")
    assert len(err.message) < 400


def test_a_site_gets_a_limited_number_of_calls_in_flight() -> None:
    s = Served(CoordinatorConfig(total_rounds=2, min_sites=2), limits=ServerLimits(max_rpcs=16, max_rpcs_per_site=2))
    try:
        s.join("a", "b")
        waits = [threading.Thread(target=lambda: s.client.wait_round("a", 0, timeout_s=3)) for _ in range(2)]
        for t in waits:
            t.start()
        time.sleep(0.5)  # both waits are in flight
        _refused(lambda: s.client.wait_round("a", 0, timeout_s=3), "resource_exhausted", "calls in flight")
        assert s.client.heartbeat("b").committed_rounds == 0  # another site is not held up
        for t in waits:
            t.join()
    finally:
        s.close()


def _stalled_push(
    address: str, site: str, release: threading.Event, first_chunk: bool = False, details: list[str] | None = None
) -> tuple[threading.Thread, list[object]]:
    """A raw push stream that sends its header (and its first chunk) and then nothing until
    ``release``; ``out`` gets how the call ended (``details``: what a refusal said)."""
    out: list[object] = []

    def messages():
        yield pb.PushMessage(header=pb.PushHeader(site_id=site, round=0, tokens=10, inner_steps=1, parts=1))
        if first_chunk:
            delta = {n: torch.zeros_like(t) for n, t in _theta().items()}
            yield pb.PushMessage(chunk=chunk_to_proto(next(iter(encode_chunks(delta, codec=FP32)))))
        release.wait(30)

    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                out.append(pb_grpc.CoordinatorStub(ch).PushDelta(messages(), timeout=30))
            except grpc.RpcError as e:
                out.append(e.code())
                if details is not None:
                    details.append(e.details())

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_pushes_that_stop_sending_are_cancelled_and_free_their_staging_buffers() -> None:
    """Two pushes that sent a header and then nothing held both staging buffers: every valid
    push waited until its deadline. Now a buffer is taken only with the first chunk, one per
    site, and an idle stream is cancelled after stream_idle_s."""
    cfg = CoordinatorConfig(total_rounds=2, min_sites=3, max_concurrent_pushes=2)
    s = Served(cfg, limits=ServerLimits(stream_idle_s=1.0))
    release = threading.Event()
    try:
        s.join("a", "b", "c")
        stalled = [_stalled_push(s.address, site, release, first_chunk=True) for site in ("b", "c")]
        time.sleep(0.3)  # both hold a staging buffer now
        _t, again = _stalled_push(s.address, "b", release, first_chunk=True)
        _t.join(10)
        assert again == [grpc.StatusCode.RESOURCE_EXHAUSTED]  # one buffer per site
        assert s.push("a", 0).accepted  # gets a buffer once the idle ones are cancelled
        for t, out in stalled:
            t.join(10)
            assert out == [grpc.StatusCode.CANCELLED]
        assert s.server.watch.cancelled >= 2
        assert s.push("b", 0).accepted and s.push("c", 0).accepted  # their real pushes still count
        assert s.client.wait_round("a", 0, timeout_s=10).committed_rounds == 1
    finally:
        release.set()
        s.close()


def test_pushes_stalled_after_their_first_chunk_do_not_delay_another_sites_push() -> None:
    """Two pushes that sent one chunk and then nothing held both staging buffers until the stream
    idle cut (30 s): a valid push waited, past its deadline. Now a push that waits for a buffer
    takes the one of a holder stalled for staging_stall_s, while the stalled streams are still
    open (here the idle cut is 600 s, the wait for a buffer 120 s, the client's deadline 20 s);
    the stalled push is refused when it goes on, and nothing of it counted."""
    cfg = CoordinatorConfig(total_rounds=2, min_sites=3, max_concurrent_pushes=2, staging_timeout_s=120.0, staging_stall_s=0.5)
    s = Served(cfg, limits=ServerLimits(stream_idle_s=600.0))
    release, said = threading.Event(), []
    try:
        s.join("a", "b", "c")
        stalled = [_stalled_push(s.address, site, release, first_chunk=True, details=said) for site in ("b", "c")]
        staging = s.coord.intake.staging
        while staging.free:  # until both hold a buffer
            time.sleep(0.01)
        assert s.push("a", 0).accepted
        assert all(t.is_alive() and out == [] for t, out in stalled)  # accepted while both stalled streams are open
        assert s.server.watch.cancelled == 0
        release.set()  # the stalled clients end their streams
        for t, _out in stalled:
            t.join(10)
        # One lost its buffer to a's push; the other kept it, and its push is incomplete.
        assert sorted(code.name for _t, out in stalled for code in out) == ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
        lost = next(d for d in said if "staging buffer" in d)
        assert "sent no chunk for" in lost and "given to another push" in lost and "nothing of this push was counted" in lost
        assert staging.free == 2 and s.coord.committed_rounds == 0
        assert s.push("b", 0).accepted and s.push("c", 0).accepted  # their real pushes count: nothing of the stalled ones did
        assert s.client.wait_round("a", 0, timeout_s=10).committed_rounds == 1
    finally:
        release.set()
        s.close()


def test_too_many_calls_in_all_are_refused_at_once_not_queued() -> None:
    s = Served(CoordinatorConfig(total_rounds=2, min_sites=2), limits=ServerLimits(max_rpcs=3, max_rpcs_per_site=8, stream_idle_s=2.0))
    release = threading.Event()
    try:
        s.join("a", "b")
        stalled = [_stalled_push(s.address, "a", release) for _ in range(3)]
        time.sleep(0.3)
        _refused(lambda: s.client.heartbeat("b"), "resource_exhausted")
        for t, _out in stalled:
            t.join(10)
        assert s.client.heartbeat("b").committed_rounds == 0  # the slots are free again
    finally:
        release.set()
        s.close()
