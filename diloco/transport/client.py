"""The site's side of the wire: typed calls in, domain types out, RemoteError on refusal."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import grpc

from diloco.boxes import Box
from diloco.errors import Kind, RemoteError
from diloco.security.config import SecurityConfig
from diloco.transport import serde
from diloco.transport.limits import MAX_MESSAGE_BYTES
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.security import client_side
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval

# gRPC's status codes as the project's refusal kinds (diloco.errors). A call that could not
# reach the coordinator, or timed out, or was cancelled under it, is "unavailable": retried.
_KINDS: dict[grpc.StatusCode, Kind] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.FAILED_PRECONDITION: "failed_precondition",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.OUT_OF_RANGE: "out_of_range",
    grpc.StatusCode.ABORTED: "aborted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable",
    grpc.StatusCode.CANCELLED: "unavailable",
}


_PUSH_DELTA = "/diloco.v1.Coordinator/PushDelta"  # the paths coordinator_pb2_grpc's stub calls
_UPLOAD_INIT = "/diloco.v1.Coordinator/UploadInit"


def _remote(e: grpc.RpcError) -> RemoteError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    kind = _KINDS.get(code, "internal") if code is not None else "internal"
    return RemoteError(kind, details if kind != "internal" else f"{code.name if code else 'UNKNOWN'}: {details}")


class CoordinatorClient:
    """One channel to the coordinator at ``address`` ("host:port").

    ``connect_timeout_s`` is how long a call waits for the coordinator to come up (a site may
    start first); ``timeout_s`` bounds each call once connected. ``security``: the run's
    credentials, used as site ``site_id`` (None: plaintext, loopback only). ``streams`` > 1
    opens that many channels, each its own TCP connection, for striped pushes and pulls
    (``lane``). All methods are thread-safe.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 60.0,
        security: SecurityConfig | None = None,
        site_id: str = "",
        streams: int = 1,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        side = client_side(security or SecurityConfig(), address, site_id)
        self._md = side.metadata
        options = [
            *side.options,
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Reconnect to a restarted coordinator within seconds (gRPC's default backoff
            # grows to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 4000),
        ]
        if streams < 1:
            raise ValueError(f"streams={streams}: must be >= 1")
        # A channel of its own subchannel pool is a connection of its own (channels with the
        # same target and options would otherwise share one TCP connection).
        lanes = [options if i == 0 else [*options, ("grpc.use_local_subchannel_pool", 1)] for i in range(streams)]
        if side.credentials is None:
            self._channels = [grpc.insecure_channel(address, options=o) for o in lanes]
        else:
            self._channels = [grpc.secure_channel(address, side.credentials, options=o) for o in lanes]
        self._channel = self._channels[0]
        self._stubs = [pb_grpc.CoordinatorStub(c) for c in self._channels]
        self._stub = self._stubs[0]
        # The push streams' chunks go to their wire bytes without a protobuf message each
        # (serde.push_message_to_wire); the stubs' own PushDelta would build three copies.
        self._pushes = [
            c.stream_unary(_PUSH_DELTA, request_serializer=serde.push_message_to_wire, response_deserializer=pb.PushReply.FromString) for c in self._channels
        ]
        self._upload = self._channel.stream_unary(_UPLOAD_INIT, request_serializer=serde.push_message_to_wire, response_deserializer=pb.PushReply.FromString)

    @property
    def streams(self) -> int:
        return len(self._channels)

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, request: JoinRequest) -> JoinInfo:
        """Joins the run: the coordinator checks what the site states and answers with the run's
        settings (diloco.sync.settings)."""
        req = serde.join_request_to_proto(request)
        try:
            # wait_for_ready: a site started before its coordinator waits instead of failing.
            reply = self._stub.Join(req, timeout=self.connect_timeout_s, wait_for_ready=True, metadata=self._md)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.join_info_from_proto(reply)

    def push(self, header: PushHeader, chunks: Iterable[Chunk], lane: int = 0) -> PushResult:
        return self._stream(self._pushes[lane % len(self._pushes)], header, chunks)

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        """Sends this site's parameters as θ₀ (float32 chunks), when Join asked for them."""
        return self._stream(self._upload, header, chunks)

    def _stream(self, rpc: grpc.StreamUnaryMultiCallable, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        def messages() -> Iterator[pb.PushMessage | Chunk]:
            yield pb.PushMessage(header=serde.header_to_proto(header))
            yield from chunks  # serde.push_message_to_wire writes each

        try:
            reply = rpc(messages(), timeout=self.timeout_s, wait_for_ready=True, metadata=self._md)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.push_result_from_proto(reply)

    def wait_round(self, site_id: str, round: int, timeout_s: float) -> RoundStatus:
        req = pb.WaitRequest(site_id=site_id, round=round, timeout_s=timeout_s)
        try:
            reply = self._stub.WaitRound(req, timeout=timeout_s + self.timeout_s, wait_for_ready=True, metadata=self._md)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.status_from_proto(reply)

    def pull_update(
        self,
        site_id: str,
        round: int,
        want: Mapping[str, Box] | None = None,
        lane: int = 0,
        wait_s: float = 0.0,
        on_committed: Callable[[], None] | None = None,
    ) -> list[Chunk] | None:
        """Round ``round``'s encoded update; with ``want``, only the chunks overlapping those slices.
        With ``wait_s`` > 0 the coordinator first waits up to that long for the round's commit:
        None if it is still open then (``start_pull``)."""
        if wait_s <= 0:
            stub = self._stubs[lane % len(self._stubs)]
            return self._pull(stub.PullUpdate, pb.PullRequest(site_id=site_id, round=round, want=serde.boxes_to_proto(want)))
        return self.start_pull(site_id, round, want, lane, wait_s).result(on_committed)

    def start_pull(self, site_id: str, round: int, want: Mapping[str, Box] | None = None, lane: int = 0, wait_s: float = 30.0) -> PullCall:
        """Sends a PullUpdate that the coordinator holds until round ``round`` is committed (up to
        ``wait_s``) and returns at once: the site may send it before its push has been answered,
        so that the update leaves the coordinator the moment the round closes."""
        if not wait_s > 0:
            raise ValueError(f"start_pull: wait_s={wait_s!r} must be > 0")
        stub = self._stubs[lane % len(self._stubs)]
        req = pb.PullRequest(site_id=site_id, round=round, want=serde.boxes_to_proto(want), wait_s=wait_s)
        try:
            return PullCall(stub.PullUpdate(req, timeout=wait_s + self.timeout_s, wait_for_ready=True, metadata=self._md), round)
        except grpc.RpcError as e:
            raise _remote(e) from None

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk]]:
        """θ after the last committed round: the round status (its ``committed_rounds`` is
        the open round), then θ's chunks (with ``want``, only those overlapping the slices)."""
        status, chunks, _ = self._pull_global(site_id, want, outer_state=False)
        return status, chunks

    def pull_global_with_state(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk], list[Chunk]]:
        """``pull_global``, and the outer optimizer's momentum buffers of the same round."""
        return self._pull_global(site_id, want, outer_state=True)

    def _pull_global(self, site_id: str, want: Mapping[str, Box] | None, outer_state: bool) -> tuple[RoundStatus, list[Chunk], list[Chunk]]:
        req = pb.PullRequest(site_id=site_id, want=serde.boxes_to_proto(want), outer_state=outer_state)
        try:
            messages = list(self._stub.PullGlobal(req, timeout=self.timeout_s, wait_for_ready=True, metadata=self._md))
        except grpc.RpcError as e:
            raise _remote(e) from None
        kinds = [m.WhichOneof("kind") for m in messages]
        body = kinds[1:]
        n = body.count("chunk")
        if not kinds or kinds[0] != "status" or body != ["chunk"] * n + ["momentum"] * (len(body) - n) or (not outer_state and n < len(body)):
            raise RemoteError("internal", "PullGlobal must answer with the round status, then θ's chunks, then (asked for) the momentum's")
        chunks = [serde.chunk_from_proto(m.chunk) for m in messages[1 : 1 + n]]
        return serde.status_from_proto(messages[0].status), chunks, [serde.chunk_from_proto(m.momentum) for m in messages[1 + n :]]

    def _pull(self, rpc: grpc.UnaryStreamMultiCallable, req: pb.PullRequest) -> list[Chunk]:
        try:
            return [serde.chunk_from_proto(m) for m in rpc(req, timeout=self.timeout_s, wait_for_ready=True, metadata=self._md)]
        except grpc.RpcError as e:
            raise _remote(e) from None

    def heartbeat(self, site_id: str, timeout_s: float | None = None) -> RoundStatus:
        try:
            reply = self._stub.Heartbeat(pb.HeartbeatRequest(site_id=site_id), timeout=timeout_s or self.timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            raise _remote(e) from None
        return serde.status_from_proto(reply)

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None:
        """Leaves the run, reporting the hash of the site's θ (and its last evaluation of it)."""
        req = pb.LeaveRequest(site_id=site_id, global_sha256=global_sha256, **serde.eval_fields(eval))
        try:
            self._stub.Leave(req, timeout=self.timeout_s, wait_for_ready=True, metadata=self._md)
        except grpc.RpcError as e:
            raise _remote(e) from None


class PullCall:
    """A waiting PullUpdate in flight (``CoordinatorClient.start_pull``)."""

    def __init__(self, call: grpc.Call, round: int) -> None:
        self._call, self._round = call, round

    def result(self, on_committed: Callable[[], None] | None = None) -> list[Chunk] | None:
        """Blocks until the coordinator answers: the update's chunks, or None if the round was
        still open when the wait ended; ``on_committed`` is called as soon as the commit is
        known, before the chunks arrive. A refusal raises RemoteError."""
        call = self._call
        try:
            committed = dict(call.initial_metadata() or ()).get(serde.COMMITTED_KEY)  # type: ignore[attr-defined]
            if committed == "1" and on_committed is not None:
                on_committed()
            chunks = [serde.chunk_from_proto(m) for m in call]  # type: ignore[attr-defined]  # a refusal (no metadata) raises here
        except grpc.RpcError as e:
            raise _remote(e) from None
        if committed not in ("0", "1") or (committed == "0" and chunks):
            raise RemoteError("internal", f"PullUpdate with wait_s must say in its metadata whether round {self._round} is committed")
        return chunks if committed == "1" else None

    def cancel(self) -> None:
        """Gives the call up (its push did not count, or failed): the coordinator stops waiting."""
        self._call.cancel()
