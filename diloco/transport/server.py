"""A thin gRPC servicer over a CoordinatorService: translate, call, map refusals to status codes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc

from diloco.errors import CoordinatorError
from diloco.transport import serde
from diloco.transport.limits import MAX_MESSAGE_BYTES
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.protocol import CoordinatorService

_STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "aborted": grpc.StatusCode.ABORTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


def _abort(context: grpc.ServicerContext, e: CoordinatorError) -> None:
    context.abort(_STATUS.get(e.kind, grpc.StatusCode.UNKNOWN), e.message)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: CoordinatorService) -> None:
        self._c = coordinator

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            j = serde.join_request_from_proto(request)
            info = self._c.join(j.site_id, j.specs, can_upload=j.can_upload, sync_every=j.sync_every, codec=j.codec)
        except CoordinatorError as e:
            _abort(context, e)
        return serde.join_info_to_proto(info)

    def PushDelta(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        return self._stream(request_iterator, context, self._c.push, "push")

    def UploadInit(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        return self._stream(request_iterator, context, self._c.upload_init, "upload of θ₀")

    def _stream(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext, take, what: str) -> pb.PushReply:
        """A header, then chunks: the framing of a push and of the upload of θ₀."""
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {what} must start with a PushHeader message")
        header = serde.header_from_proto(first.header)

        def chunks():
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise CoordinatorError("invalid_argument", f"a {what} carries exactly one header, first")
                yield serde.chunk_from_proto(msg.chunk)

        try:
            result = take(header, chunks())
        except CoordinatorError as e:
            _abort(context, e)
        return serde.push_result_to_proto(result)

    def WaitRound(self, request: pb.WaitRequest, context: grpc.ServicerContext) -> pb.RoundStatus:
        try:
            status = self._c.wait_round(request.site_id, request.round, min(request.timeout_s, 60.0))
        except CoordinatorError as e:
            _abort(context, e)
        return serde.status_to_proto(status)

    def PullUpdate(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
        try:
            chunks = self._c.pull_update(request.site_id, request.round, serde.boxes_from_proto(request.want))
        except CoordinatorError as e:
            _abort(context, e)
        for c in chunks:
            yield serde.chunk_to_proto(c)

    def PullGlobal(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.GlobalMessage]:
        try:
            status, chunks = self._c.pull_global(request.site_id, serde.boxes_from_proto(request.want))
        except CoordinatorError as e:
            _abort(context, e)
        yield pb.GlobalMessage(status=serde.status_to_proto(status))
        for c in chunks:
            yield pb.GlobalMessage(chunk=serde.chunk_to_proto(c))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.RoundStatus:
        try:
            status = self._c.heartbeat(request.site_id)
        except CoordinatorError as e:
            _abort(context, e)
        return serde.status_to_proto(status)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        try:
            self._c.leave(request.site_id, request.global_sha256, serde.eval_from_proto(request))
        except CoordinatorError as e:
            _abort(context, e)
        return pb.LeaveReply()


def serve(coordinator: CoordinatorService, host: str = "127.0.0.1", port: int = 0, max_workers: int = 32) -> tuple[grpc.Server, int]:
    """Starts a gRPC server for ``coordinator``; returns it and the bound port (port 0: any free)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="coordinator-rpc"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the coordinator to {host}:{port}")
    server.start()
    return server, bound
