"""A held pull streams a round's update while the round's checkpoint is being written, and its
stream ends only once the round is durable: the transfer overlaps the checkpoint, and a site
(which applies nothing before its stream has ended well) never applies a round that a restart
could lose. Real gRPC on 127.0.0.1; the checkpoint is held at a gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from helpers import expect_refused
from helpers import small_theta as _theta

from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator import service as coordinator_service
from diloco.errors import RemoteError
from diloco.outer import OuterConfig
from diloco.transport import CoordinatorClient, serve
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.serde import COMMITTED_KEY
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)
FP32 = get_codec("fp32")


class Gated:
    """A coordinator (one site a round, a checkpoint every commit) whose commit checkpoints
    wait for ``release``; with ``fail`` set they raise instead of writing."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release, self.writing = threading.Event(), threading.Event()
        self.fail = False
        real = coordinator_service.save_checkpoint

        def gated(d: Path, round: int, state: dict, *args: object, **kw: object) -> Path:
            self.writing.set()
            assert self.release.wait(30)
            if self.fail:
                raise OSError("no space left on device (test)")
            return real(d, round, state, *args, **kw)

        monkeypatch.setattr(coordinator_service, "save_checkpoint", gated)
        self.coord = Coordinator(_theta(), OuterConfig(), CoordinatorConfig(total_rounds=3, min_sites=1, checkpoint_dir=str(directory)))
        self.fatal: list[str] = []
        self.coord.on_fatal.append(lambda what, _e: self.fatal.append(what))
        self.server, port = serve(self.coord, "127.0.0.1", 0)
        self.client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=20, connect_timeout_s=10)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.client.join(JoinRequest("a", tuple(fingerprint(_theta()).values())))

    def push_in_background(self) -> tuple[threading.Thread, list[object]]:
        """Site a's push of round 0, which closes the round: it returns once the round is published."""
        out: list[object] = []
        chunks = encode_chunks({n: torch.full_like(t, 0.1) for n, t in _theta().items()}, codec=FP32)
        header = PushHeader(site_id="a", round=0, tokens=10, train_loss=1.0, inner_steps=1)

        def push() -> None:
            try:
                out.append(self.client.push(header, chunks))
            except RemoteError as e:
                out.append(e)

        t = threading.Thread(target=push)
        t.start()
        assert self.writing.wait(10)  # the round is computed; its checkpoint is being written
        return t, out

    def close(self) -> None:
        self.release.set()
        self.client.close()
        self.channel.close()
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gated]:
    g = Gated(tmp_path, monkeypatch)
    try:
        yield g
    finally:
        g.close()


def test_the_update_streams_during_the_checkpoint_and_the_stream_ends_once_durable(gated: Gated) -> None:
    pusher, pushed = gated.push_in_background()
    stream = gated.stub.PullUpdate(pb.PullRequest(site_id="a", round=0, wait_s=10), timeout=30)
    assert dict(stream.initial_metadata())[COMMITTED_KEY] == "1"
    first = next(stream)  # the update is on its way before the round is durable
    assert gated.coord.committed_rounds == 0 and not gated.release.is_set()
    rest: list[pb.TensorChunk] = []
    drain = threading.Thread(target=lambda: rest.extend(stream))
    drain.start()
    time.sleep(0.5)
    assert drain.is_alive(), "the stream ended before the round was durable"
    # A site's pull hands nothing on before its stream has ended: it is still waiting too.
    got: list[object] = []
    site_pull = threading.Thread(target=lambda: got.append(gated.client.pull_update("a", 0, wait_s=10)))
    site_pull.start()
    time.sleep(0.3)
    assert got == [] and site_pull.is_alive()
    gated.release.set()
    for t in (drain, pusher, site_pull):
        t.join(10)
        assert not t.is_alive()
    assert stream.code() == grpc.StatusCode.OK and gated.coord.committed_rounds == 1
    assert pushed[0].accepted  # type: ignore[union-attr]
    # What streamed early is the update every later pull gets, and it makes θ the coordinator's.
    plain = gated.client.pull_update("a", 0)
    assert [first.payload, *(m.payload for m in rest)] == [c.payload for c in plain]
    assert [c.payload for c in got[0]] == [c.payload for c in plain]  # type: ignore[union-attr]
    theta = _theta()
    for c in plain:
        theta[c.name].view(-1)[c.offset : c.offset + c.numel] += FP32.decode(c.payload, c.numel)
    assert all(torch.equal(theta[n], p) for n, p in gated.coord.global_params().items())
    assert gated.coord.commit_timings()[-1]["checkpoint_s"] >= 0.5  # the gate held it


def test_a_checkpoint_that_fails_ends_the_streamed_pull_unavailable(gated: Gated) -> None:
    """The round was computed and its update sent, but it never became durable: the pull's
    stream ends with an error, so the site applies nothing and, after the restart, pushes
    the round again."""
    gated.fail = True
    pusher, pushed = gated.push_in_background()
    got: list[object] = []
    site_pull = threading.Thread(target=lambda: got.append(expect_refused(lambda: gated.client.pull_update("a", 0, wait_s=10), "unavailable")))
    site_pull.start()
    time.sleep(0.3)
    gated.release.set()
    for t in (site_pull, pusher):
        t.join(10)
        assert not t.is_alive()
    assert got and "must be restarted from its checkpoint" in str(got[0])
    assert isinstance(pushed[0], RemoteError) and pushed[0].kind == "unavailable"
    assert gated.coord.committed_rounds == 0 and gated.fatal == ["the checkpoint of round 0"]


def test_a_plain_pull_still_needs_a_durable_round(gated: Gated) -> None:
    """Only a held pull streams early (its stream ends once durable); a plain pull, whose
    answer is whole when it returns, is refused until the round is durable."""
    pusher, _ = gated.push_in_background()
    expect_refused(lambda: gated.client.pull_update("a", 0), "failed_precondition", says=("round 0 is not committed yet",))
    assert gated.coord.pull_update("a", 0, wait_s=0.2) is None  # in process, without early: not before durable
    gated.release.set()
    pusher.join(10)
    assert gated.coord.committed_rounds == 1 and gated.client.pull_update("a", 0)
