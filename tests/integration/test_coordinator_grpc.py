"""The coordinator behind a real gRPC server on 127.0.0.1:0: good pushes, and every bad
input refused with a status that says what was wrong, leaving θ unchanged."""

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers import coordinator, expect_refused, filled, join, push, served_client
from helpers import small_theta as _theta

from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.errors import RemoteError
from diloco.transport import CoordinatorClient, ServerLimits, serve
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.types import Chunk, JoinRequest, PushHeader, TensorSpec
from diloco.wire import encode_chunks

pytestmark = pytest.mark.timeout(60)
FP32 = get_codec("fp32")
DELTA = filled(_theta(), 0.1)


@pytest.fixture
def served() -> Iterator[tuple[Coordinator, CoordinatorClient]]:
    coord = coordinator(_theta(), CoordinatorConfig(total_rounds=3, min_sites=2))
    with served_client(coord) as client:
        yield coord, client


def test_round_commits_when_every_site_pushed_and_sites_get_identical_theta(served) -> None:
    coord, client = served
    join(client, _theta(), "a", "b")
    assert push(client, "a", 0, DELTA, tokens=10).accepted
    assert coord.committed_rounds == 0
    assert client.wait_round("a", 0, timeout_s=0.1).committed_rounds == 0  # times out, still open
    assert push(client, "b", 0, filled(_theta(), 0.3), tokens=30).accepted
    status = client.wait_round("a", 0, timeout_s=5)
    assert status.committed_rounds == 1
    # A repeated push for the committed round is acknowledged and ignored.
    again = push(client, "a", 0, DELTA)
    assert again.duplicate and not again.accepted
    assert coord.committed_rounds == 1
    # Applying the pulled update to θ_0 gives exactly the coordinator's θ_1.
    theta = _theta()
    for c in client.pull_update("a", 0):
        theta[c.name].view(-1)[c.offset : c.offset + c.numel] += FP32.decode(c.payload, c.numel)
    from diloco.outer import params_sha256

    assert params_sha256(theta) == coord.global_sha256() == status.global_sha256
    # Weighted mean: (0.1·10 + 0.3·30)/40 = 0.25; Nesterov first step moves θ by −0.7·(1.9·0.25).
    torch.testing.assert_close(theta["layer.b"], _theta()["layer.b"] - 0.7 * 1.9 * 0.25)


def test_a_waiting_pull_is_held_until_the_commit_then_sends_the_update_at_once(served) -> None:
    """PullUpdate with wait_s: the site's wait and pull in one call (one round trip fewer per
    round on a slow link). Still open after wait_s: None; committed while it waits: the
    commit is signalled before the chunks, and the chunks are the plain pull's."""
    coord, client = served
    join(client, _theta(), "a", "b")
    assert push(client, "a", 0, DELTA).accepted
    seen: list[str] = []
    assert client.pull_update("a", 0, wait_s=0.2, on_committed=lambda: seen.append("committed")) is None
    assert seen == [] and coord.committed_rounds == 0
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(client.pull_update("a", 0, wait_s=20, on_committed=lambda: seen.append("committed"))))
    waiter.start()
    time.sleep(0.3)  # the pull is held at the coordinator
    assert got == [] and waiter.is_alive()
    assert push(client, "b", 0, filled(_theta(), 0.3)).accepted
    waiter.join(10)
    assert not waiter.is_alive() and seen == ["committed"]
    plain = client.pull_update("a", 0)
    assert [(c.name, c.offset, c.payload) for c in got[0]] == [(c.name, c.offset, c.payload) for c in plain]
    # Refusals name what was wrong, as for a plain pull; a waiting pull of a committed round is a plain pull.
    _expect_refused(lambda: client.pull_update("a", 7, wait_s=1), "out_of_range", "rounds are 0..2")
    _expect_refused(lambda: client.pull_update("stranger", 0, wait_s=1), "failed_precondition")
    assert [c.payload for c in client.pull_update("b", 0, wait_s=5)] == [c.payload for c in plain]


@pytest.mark.parametrize("wait_s", [0.0, 1.0])
def test_a_pull_of_a_round_outside_the_run_is_refused_whether_or_not_it_waits(served, wait_s: float) -> None:
    """Round −1 without a wait was answered "no longer kept" (not_found, which a site takes for
    a pull of θ), a round past the end "not committed yet": both are out of the run's range."""
    _coord, client = served
    join(client, _theta(), "a", "b")
    for r in (-1, -(2**40), 3, 7, 2**62):
        _expect_refused(lambda r=r: client.pull_update("a", r, wait_s=wait_s), "out_of_range", f"round {r}", "rounds are 0..2")


def test_a_pull_given_up_while_it_waits_changes_nothing(served) -> None:
    """A site cancels its held pull (its push failed, or came too late): the coordinator's
    handler ends when the round closes, and the round and later pulls go on as before."""
    coord, client = served
    join(client, _theta(), "a", "b")
    assert push(client, "a", 0, DELTA).accepted
    held = client.start_pull("a", 0, wait_s=20)
    time.sleep(0.2)  # held at the coordinator
    held.cancel()
    _expect_refused(held.result, "unavailable")  # as a call cut under it: a site would retry
    assert push(client, "b", 0, filled(_theta(), 0.3)).accepted
    assert coord.committed_rounds == 1
    assert [c.payload for c in client.pull_update("a", 0, wait_s=5)] == [c.payload for c in client.pull_update("b", 0)]


@pytest.mark.parametrize("call", ["pull", "wait_round"])
def test_a_held_call_given_up_frees_its_site_slot_at_once(call: str) -> None:
    """Under a limit of one call in flight per site, a site that cancels its held pull (or
    wait) can call again within a moment, not only when the round commits or the hold ends."""
    coord = coordinator(_theta(), CoordinatorConfig(total_rounds=3, min_sites=2))

    def when_free(fn):  # the slot of a call answered a moment ago may not be free yet
        since = time.monotonic()
        while True:
            try:
                return fn()
            except RemoteError as e:
                assert e.kind == "resource_exhausted" and time.monotonic() - since < 10, e
                time.sleep(0.05)

    with served_client(coord, limits=ServerLimits(max_rpcs_per_site=1)) as client:
        when_free(lambda: join(client, _theta(), "a"))
        when_free(lambda: join(client, _theta(), "b"))
        assert when_free(lambda: push(client, "a", 0, DELTA)).accepted
        time.sleep(0.3)
        if call == "pull":
            held = client.start_pull("a", 0, wait_s=30)
        else:
            held = client._stub.WaitRound.future(pb.WaitRequest(site_id="a", round=0, timeout_s=30), timeout=30)
        time.sleep(0.3)  # a heartbeat sent before the held call reaches the coordinator would take its slot
        since = time.monotonic()
        while True:  # until the held call has reached the coordinator and holds the slot
            try:
                client.heartbeat("a")
            except RemoteError as e:
                assert e.kind == "resource_exhausted" and "calls in flight" in e.message, e
                break
            assert time.monotonic() - since < 10, "the held call never reached the coordinator"
            time.sleep(0.05)
        held.cancel()
        given_up = time.monotonic()
        when_free(lambda: client.heartbeat("a"))
        print(f"{call}: site slot free {time.monotonic() - given_up:.2f} s after the cancel")
        assert coord.committed_rounds == 0  # freed by the cancellation, not by a commit
        assert push(client, "b", 0, DELTA).accepted and coord.committed_rounds == 1


def _expect_refused(fn, code: str, *fragments: str) -> None:
    expect_refused(fn, code, says=fragments)


def _raw_push(client: CoordinatorClient, header: PushHeader, chunks: list[Chunk]):
    return client.push(header, iter(chunks))


def test_bad_pushes_are_refused_and_change_nothing(served) -> None:
    coord, client = served
    join(client, _theta(), "a", "b")
    before = coord.global_sha256()
    good = list(encode_chunks(DELTA, codec=FP32))
    header = PushHeader(site_id="a", round=0, tokens=10, train_loss=1.0, inner_steps=1)

    def with_first(**kw):
        c = good[0]
        fields = dict(name=c.name, shape=c.shape, dtype=c.dtype, offset=c.offset, numel=c.numel, codec=c.codec, payload=c.payload)
        fields.update(kw)
        return [Chunk(**fields)] + good[1:]

    cases = [
        (lambda: _raw_push(client, header, with_first(name="layer.nope")), "invalid_argument", ["unknown parameter 'layer.nope'"]),
        (lambda: _raw_push(client, header, with_first(shape=(4,))), "invalid_argument", ["shape [3]", "chunk declares [4]"]),
        (lambda: _raw_push(client, header, with_first(dtype="float16")), "invalid_argument", ["dtype float32", "float16"]),
        (lambda: _raw_push(client, header, good[:1]), "invalid_argument", ["incomplete", "layer.w"]),
        (lambda: push(client, "a", 0, filled(_theta(), float("nan"))), "invalid_argument", ["non-finite"]),
        (lambda: push(client, "a", 1, DELTA), "failed_precondition", ["round 1 is not open", "open round is 0"]),
        (lambda: push(client, "a", 7, DELTA), "out_of_range", ["round 7"]),
        (lambda: push(client, "stranger", 0, DELTA), "failed_precondition", ["'stranger' has not joined"]),
        (lambda: push(client, "a", 0, DELTA, tokens=0), "invalid_argument", ["tokens=0"]),
    ]
    for fn, code, fragments in cases:
        _expect_refused(fn, code, *fragments)
        assert coord.global_sha256() == before
        assert coord.committed_rounds == 0
    # The coordinator keeps serving: the refused pushes left no trace in the round.
    assert push(client, "a", 0, DELTA).accepted
    assert push(client, "b", 0, DELTA).accepted
    assert coord.committed_rounds == 1


def test_bad_codec_payloads_are_refused_and_change_nothing(served) -> None:
    """Codec-level bad input, decoded chunk by chunk as the push streams in: a payload whose
    header disagrees with the chunk, a truncated payload, an unknown codec, and zstd frames
    that would inflate past what the declared elements can need (decompression bombs)."""
    import zstandard

    coord, client = served
    join(client, _theta(), "a", "b")
    before = coord.global_sha256()
    header = PushHeader(site_id="a", round=0, tokens=10, train_loss=1.0, inner_steps=1)
    int8 = get_codec("int8")
    w = DELTA["layer.w"].reshape(-1)  # 12 elements; "layer.b" (3) sorts first
    good = {c.name: c for c in encode_chunks(DELTA, codec=int8)}

    def with_w(codec: str, payload: bytes) -> list[Chunk]:
        c = good["layer.w"]
        return [good["layer.b"], Chunk(name=c.name, shape=c.shape, dtype=c.dtype, offset=0, numel=12, codec=codec, payload=payload)]

    bomb_declared = get_codec("fp32+zstd").encode(torch.zeros(1 << 20))  # frame says 4 MiB of content
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 22))
    bomb_undeclared = bomb_declared[:4] + undeclared  # same 4-byte codec header, a frame without a size
    cases = [
        (with_w("int8", int8.encode(w[:6])), ["int8 payload header declares 6 elements, the chunk declares 12"]),
        (with_w("int4", int8.encode(w)), ["int4 payload starts with magic byte"]),
        (with_w("int8", int8.encode(w)[:-3]), ["int8 payload has", "expected"]),
        (with_w("gzip", int8.encode(w)), ["unknown codec 'gzip'", "int8"]),
        (with_w("fp32+zstd", bomb_declared), ["declares 4194304 bytes of content", "refusing to inflate"]),
        (with_w("fp32+zstd", bomb_undeclared), ["content over 48 bytes"]),
    ]
    for chunks, fragments in cases:
        _expect_refused(lambda: _raw_push(client, header, chunks), "invalid_argument", "chunk of 'layer.w' at elements [0, 12)", *fragments)  # noqa: B023 - called at once
        assert coord.global_sha256() == before
        assert coord.committed_rounds == 0
    # The coordinator keeps serving, and an int8 round commits normally.
    assert _raw_push(client, header, list(good.values())).accepted
    assert push(client, "b", 0, DELTA).accepted
    assert coord.committed_rounds == 1


def test_a_withheld_push_crosses_the_wire_and_the_round_goes_on_without_it(served) -> None:
    """A site with no Δ for the round sends a header with ``withheld`` and no chunks: the round
    closes once the other site pushed, with only its Δ; a withheld push that carries chunks, or
    one with a reason no one can read, is refused and changes nothing."""
    coord, client = served
    join(client, _theta(), "a", "b")
    before = coord.global_sha256()
    lost = PushHeader(site_id="a", round=0, tokens=10, train_loss=1.0, inner_steps=1, withheld="lost on the way")
    good = list(encode_chunks(DELTA, codec=FP32))
    _expect_refused(lambda: _raw_push(client, lost, good), "invalid_argument", "withheld ('lost on the way') yet carries chunks")
    _expect_refused(
        lambda: _raw_push(client, PushHeader(**{**lost.__dict__, "withheld": "x" * 600}), []), "invalid_argument", "withheld: a reason of at most 512"
    )
    assert coord.global_sha256() == before and coord.committed_rounds == 0
    result = _raw_push(client, lost, [])
    assert result.accepted and result.refused == "withheld by the site: lost on the way" and result.payload_bytes == 0
    assert coord.committed_rounds == 0  # b has not answered yet
    assert push(client, "b", 0, filled(_theta(), 0.2)).accepted
    assert coord.committed_rounds == 1
    solo = coordinator(_theta(), CoordinatorConfig(total_rounds=3, min_sites=1), sites=("b",))
    push(solo, "b", 0, filled(_theta(), 0.2))
    assert coord.global_sha256() == solo.global_sha256()  # θ moved by b's Δ alone


def test_push_must_start_with_a_header(served) -> None:
    coord, client = served
    join(client, _theta(), "a")
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(client.address))
    chunk = next(encode_chunks(DELTA, codec=FP32))
    with pytest.raises(grpc.RpcError) as info:
        stub.PushDelta(iter([pb.PushMessage(chunk=pb.TensorChunk(name=chunk.name))]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PushHeader" in info.value.details()


def test_join_refuses_a_mismatched_model_naming_the_differences(served) -> None:
    _, client = served
    specs = [TensorSpec("layer.w", (4, 4), "float32"), TensorSpec("layer.b", (3,), "float16"), TensorSpec("extra", (1,), "float32")]
    _expect_refused(
        lambda: client.join(JoinRequest("a", tuple(specs))), "invalid_argument", "'layer.w'", "[4, 3]", "[4, 4]", "float16", "unexpected parameter 'extra'"
    )


def test_pulls_need_a_joined_site_and_a_committed_round(served) -> None:
    _, client = served
    _expect_refused(lambda: client.pull_global("ghost"), "failed_precondition", "'ghost' has not joined")
    join(client, _theta(), "a")
    _expect_refused(lambda: client.pull_update("a", 0), "failed_precondition", "round 0 is not committed")
    status, chunks = client.pull_global("a")
    assert {c.name for c in chunks} == set(_theta()) and status.committed_rounds == 0


def _rpc_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("coordinator-rpc")}


def test_stopping_the_server_ends_its_worker_threads() -> None:
    """grpc's own stop leaves its pool's threads idle until the pool is collected; a
    coordinator's Server ends them once the calls in flight have ended."""
    before = _rpc_threads()
    coord = coordinator(_theta(), CoordinatorConfig(total_rounds=3, min_sites=2))
    server, port = serve(coord, "127.0.0.1", 0)
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=10, connect_timeout_s=10)
    try:
        join(client, _theta(), "a", "b")
        assert push(client, "a", 0, DELTA).accepted
        assert _rpc_threads() - before  # the calls ran on the server's pool
    finally:
        client.close()
        assert server.stop(grace=None).wait(5)
    deadline = time.monotonic() + 10
    while _rpc_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _rpc_threads() - before
