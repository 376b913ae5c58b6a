"""The site's side of the wire: typed calls in, domain types out, RemoteError on refusal."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import grpc

from diloco.boxes import Box
from diloco.transport import serde
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.server import MAX_MESSAGE_BYTES
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec


class RemoteError(Exception):
    """The coordinator refused a call or could not be reached. ``code`` is the gRPC status name
    (e.g. "INVALID_ARGUMENT", "UNAVAILABLE"); ``message`` is the coordinator's explanation."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _remote(e: grpc.RpcError) -> RemoteError:
    code = e.code() if hasattr(e, "code") else None
    return RemoteError(code.name if code is not None else "UNKNOWN", e.details() if hasattr(e, "details") else str(e))


class CoordinatorClient:
    """One channel to the coordinator at ``address`` ("host:port").

    ``connect_timeout_s`` is how long a call waits for the coordinator to come up (a site may
    start first); ``timeout_s`` bounds each call once connected. All methods are thread-safe.
    """

    def __init__(self, address: str, *, timeout_s: float = 300.0, connect_timeout_s: float = 60.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # Reconnect to a restarted coordinator within seconds (gRPC's default backoff
                # grows to 120 s).
                ("grpc.initial_reconnect_backoff_ms", 250),
                ("grpc.min_reconnect_backoff_ms", 250),
                ("grpc.max_reconnect_backoff_ms", 4000),
            ],
        )
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, site_id: str, specs: Iterable[TensorSpec], *, can_upload: bool = False, sync_every: int = 0, codec: str = "") -> JoinInfo:
        """Joins the run; ``sync_every`` and ``codec`` (when given) must match the coordinator's,
        ``can_upload``: this site can send θ₀ if the coordinator has none yet (init=site)."""
        req = serde.join_request_to_proto(JoinRequest(site_id, tuple(specs), can_upload=can_upload, sync_every=sync_every, codec=codec))
        try:
            # wait_for_ready: a site started before its coordinator waits instead of failing.
            reply = self._stub.Join(req, timeout=self.connect_timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.join_info_from_proto(reply)

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        return self._stream(self._stub.PushDelta, header, chunks)

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """Sends this site's parameters as θ₀ (float32 chunks), when Join asked for them."""
        return self._stream(self._stub.UploadInit, header, chunks)

    def _stream(self, rpc: grpc.StreamUnaryMultiCallable, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        def messages() -> Iterator[pb.PushMessage]:
            yield pb.PushMessage(header=serde.header_to_proto(header))
            for c in chunks:
                yield pb.PushMessage(chunk=serde.chunk_to_proto(c))

        try:
            reply = rpc(messages(), timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.push_result_from_proto(reply)

    def wait_round(self, site_id: str, round: int, timeout_s: float) -> RoundStatus:
        req = pb.WaitRequest(site_id=site_id, round=round, timeout_s=timeout_s)
        try:
            reply = self._stub.WaitRound(req, timeout=timeout_s + self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.status_from_proto(reply)

    def pull_update(self, site_id: str, round: int, want: Mapping[str, Box] | None = None) -> list[Chunk]:
        """Round ``round``'s encoded update; with ``want``, only the chunks overlapping those slices."""
        return self._pull(self._stub.PullUpdate, pb.PullRequest(site_id=site_id, round=round, want=serde.boxes_to_proto(want)))

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> list[Chunk]:
        return self._pull(self._stub.PullGlobal, pb.PullRequest(site_id=site_id, want=serde.boxes_to_proto(want)))

    def _pull(self, rpc: grpc.UnaryStreamMultiCallable, req: pb.PullRequest) -> list[Chunk]:
        try:
            return [serde.chunk_from_proto(m) for m in rpc(req, timeout=self.timeout_s, wait_for_ready=True)]
        except grpc.RpcError as e:
            raise _remote(e) from None

    def heartbeat(self, site_id: str, timeout_s: float | None = None) -> RoundStatus:
        try:
            reply = self._stub.Heartbeat(pb.HeartbeatRequest(site_id=site_id), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.status_from_proto(reply)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        """Leaves the run, reporting the hash of the site's θ (and its last evaluation of it)."""
        req = pb.LeaveRequest(site_id=site_id, global_sha256=global_sha256, **serde.eval_fields(eval))
        try:
            self._stub.Leave(req, timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _remote(e) from None
