"""A thin gRPC servicer over a CoordinatorService: check who calls and what they may hold,
translate, call, map refusals to status codes."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager

import grpc

from diloco.errors import CoordinatorError
from diloco.security.config import SecurityConfig
from diloco.transport import serde
from diloco.transport.health import Health, enable_reflection
from diloco.transport.limits import MAX_MESSAGE_BYTES, PerSite, ServerLimits, StreamWatch
from diloco.transport.observed import CallObserver, observe_handler
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.protocol import CoordinatorService
from diloco.transport.security import ServerAuth, bind, server_side
from diloco.transport.serde import COMMITTED_KEY
from diloco.types import Chunk

_STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "aborted": grpc.StatusCode.ABORTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


def _gave_up(context: grpc.ServicerContext) -> threading.Event:
    """Set when the call ends (the caller cancelled it, or its deadline passed): a held wait
    then frees its worker thread at once rather than at the commit or its timeout."""
    ended = threading.Event()
    if not context.add_callback(ended.set):
        ended.set()  # already over
    return ended


def _abort(context: grpc.ServicerContext, e: CoordinatorError) -> None:
    context.abort(_STATUS.get(e.kind, grpc.StatusCode.UNKNOWN), e.message)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: CoordinatorService, auth: ServerAuth, limits: ServerLimits, watch: StreamWatch) -> None:
        self._c = coordinator
        self._auth = auth
        self._per_site = PerSite(limits.max_rpcs_per_site)
        self._watch = watch

    @contextmanager
    def _as(self, context: grpc.ServicerContext, site_id: str, identity: str | None = None, known: bool = False) -> Iterator[None]:
        """The call acts for ``site_id``: its credentials must prove that id, and the site must
        have a call slot left. ``known``: ``identity`` was established already (streams)."""
        with ExitStack() as stack:
            try:
                who = identity if known else self._auth.identify(context)
                bind(who, site_id)
                stack.enter_context(self._per_site.hold(site_id))
            except CoordinatorError as e:
                _abort(context, e)
            yield

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        with self._as(context, request.site_id):
            try:
                try:
                    j = serde.join_request_from_proto(request)
                except ValueError as e:
                    raise CoordinatorError("invalid_argument", str(e)) from None
                info = self._c.join(j)
            except CoordinatorError as e:
                _abort(context, e)
        return serde.join_info_to_proto(info)

    def PushDelta(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        return self._stream(request_iterator, context, self._c.push, "push")

    def UploadInit(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        return self._stream(request_iterator, context, self._c.upload_init, "upload of θ₀")

    def _stream(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext, take, what: str) -> pb.PushReply:
        """A header, then chunks: the framing of a push and of the upload of θ₀. The caller is
        identified before anything is read; a stream idle for ``stream_idle_s`` is cancelled."""
        try:
            identity = self._auth.identify(context)
        except CoordinatorError as e:
            _abort(context, e)
        with self._watch.track(context.cancel) as tracked:
            first = next(request_iterator, None)
            if first is None or isinstance(first, Chunk) or first.WhichOneof("kind") != "header":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {what} must start with a PushHeader message")
            tracked.touch()
            header = serde.header_from_proto(first.header)

            def chunks():
                for msg in request_iterator:  # serde.push_message_from_wire: a Chunk, or a PushMessage
                    tracked.touch()
                    if isinstance(msg, Chunk):
                        yield msg
                        continue
                    if msg.WhichOneof("kind") != "chunk":
                        raise CoordinatorError("invalid_argument", f"a {what} carries exactly one header, first")
                    yield serde.chunk_from_proto(msg.chunk)

            with self._as(context, header.site_id, identity, known=True):
                try:
                    result = take(header, chunks())
                except CoordinatorError as e:
                    _abort(context, e)
        return serde.push_result_to_proto(result)

    def WaitRound(self, request: pb.WaitRequest, context: grpc.ServicerContext) -> pb.RoundStatus:
        with self._as(context, request.site_id):
            try:
                status = self._c.wait_round(request.site_id, request.round, min(max(request.timeout_s, 0.0), 60.0), _gave_up(context))
            except CoordinatorError as e:
                _abort(context, e)
        return serde.status_to_proto(status)

    def PullUpdate(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
        with self._as(context, request.site_id):
            wait_s = min(max(request.wait_s, 0.0), 60.0) if math.isfinite(request.wait_s) else 0.0
            gave_up = _gave_up(context)
            try:
                # A held pull gets the update while the round's checkpoint is written; its
                # stream ends only once the round is durable, and the site applies nothing
                # before its stream has ended well.
                chunks = self._c.pull_update(
                    request.site_id, request.round, serde.boxes_from_proto(request.want), wait_s=wait_s, gave_up=gave_up, early=wait_s > 0
                )
            except CoordinatorError as e:
                _abort(context, e)
            if not context.is_active():
                return  # the site gave the pull up while it waited (its push failed or came late)
            if wait_s > 0:  # the commit is known now: the site hears of it before the chunks come
                context.send_initial_metadata(((COMMITTED_KEY, "0" if chunks is None else "1"),))
            if chunks is not None:
                yield from self._send(context, chunks)  # Chunk objects: _pull_serializer writes their bytes
                if wait_s > 0:
                    try:
                        self._c.wait_durable(request.round, gave_up)
                    except CoordinatorError as e:
                        _abort(context, e)

    def PullGlobal(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.GlobalMessage]:
        with self._as(context, request.site_id):
            want = serde.boxes_from_proto(request.want)
            try:
                if request.outer_state:
                    status, chunks, momentum = self._c.pull_global_with_state(request.site_id, want)
                else:
                    (status, chunks), momentum = self._c.pull_global(request.site_id, want), []
            except CoordinatorError as e:
                _abort(context, e)
            yield pb.GlobalMessage(status=serde.status_to_proto(status))
            yield from self._send(context, chunks)
            yield from self._send(context, (serde.MomentumChunk(c) for c in momentum))

    def _send(self, context: grpc.ServicerContext, messages: Iterator):
        """Yields ``messages``; a caller that stops reading for ``stream_idle_s`` is cancelled."""
        with self._watch.track(context.cancel) as tracked:
            for m in messages:
                yield m
                tracked.touch()

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.RoundStatus:
        with self._as(context, request.site_id):
            try:
                status = self._c.heartbeat(request.site_id)
            except CoordinatorError as e:
                _abort(context, e)
        return serde.status_to_proto(status)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        with self._as(context, request.site_id):
            try:
                self._c.leave(request.site_id, request.global_sha256, serde.eval_from_proto(request))
            except CoordinatorError as e:
                _abort(context, e)
        return pb.LeaveReply()


def _serializer(to_wire: Callable[[Chunk], bytes]) -> Callable[[object], bytes]:
    """The response serializer of a pull: a domain Chunk straight to its wire bytes
    (serde.chunk_to_wire: no protobuf message per chunk), a protobuf message as usual."""

    def serialize(message: object) -> bytes:
        if isinstance(message, Chunk):
            return to_wire(message)
        if isinstance(message, serde.MomentumChunk):
            return serde.momentum_chunk_to_wire(message)
        return message.SerializeToString()  # type: ignore[attr-defined]

    return serialize


class _Handlers:
    """Stands in for the server while the generated code registers the service, to keep its
    method handlers (the generated code stays the one list of the service's methods)."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def _register(servicer: CoordinatorServicer, server: grpc.Server, observer: CallObserver | None = None) -> None:
    """The generated registration, with the pulls' responses written by ``_serializer`` and
    the pushes' chunks read by ``serde.push_message_from_wire``; every call told to
    ``observer`` (diloco.transport.observed) when there is one."""
    kept = _Handlers()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, kept)
    handlers = kept.handlers
    for name in ("PushDelta", "UploadInit"):
        handlers[name] = handlers[name]._replace(request_deserializer=serde.push_message_from_wire)
    handlers["PullUpdate"] = handlers["PullUpdate"]._replace(response_serializer=_serializer(serde.chunk_to_wire))
    handlers["PullGlobal"] = handlers["PullGlobal"]._replace(response_serializer=_serializer(serde.global_chunk_to_wire))
    if observer is not None:
        handlers = {name: observe_handler(name, h, observer) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(kept.service, handlers),))
    server.add_registered_method_handlers(kept.service, handlers)


class Server:
    """The running gRPC server, its stream watch, its health service and its worker threads;
    ``stop`` stops them all."""

    def __init__(self, server: grpc.Server, watch: StreamWatch, health: Health, pool: futures.ThreadPoolExecutor) -> None:
        self._server = server
        self._pool = pool
        self.watch = watch
        self.health = health

    def set_serving(self, serving: bool) -> None:
        """What the health service answers: SERVING, or NOT_SERVING (diloco.transport.health)."""
        self.health.set_serving(serving)

    def stop(self, grace: float | None) -> object:
        """Stops serving (``grace`` seconds for calls in flight); returns grpc's stopped event.
        The worker threads end once the calls in flight have (grpc's own stop leaves them idle
        until the pool is garbage-collected)."""
        self.health.shutdown()
        self.watch.close()
        stopped = self._server.stop(grace)
        threading.Thread(target=_release, args=(stopped, self._pool), name="rpc-pool-release", daemon=True).start()
        return stopped


def _release(stopped: threading.Event, pool: futures.ThreadPoolExecutor) -> None:
    stopped.wait()
    pool.shutdown(wait=False)


def serve(
    coordinator: CoordinatorService,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    security: SecurityConfig | None = None,
    limits: ServerLimits | None = None,
    observer: CallObserver | None = None,
    serving: bool = True,
    reflection: bool = False,
) -> tuple[Server, int]:
    """Starts a gRPC server for ``coordinator``; returns it and the bound port (port 0: any
    free). ``security``: the run's credentials (None: plaintext, loopback only); ``observer``:
    told of every call (diloco.transport.observed); ``serving``: the health service's first
    answer; ``reflection``: serve gRPC server reflection too (diloco.transport.health)."""
    security = security or SecurityConfig()
    limits = limits or ServerLimits()
    credentials, auth = server_side(security, host)
    pool = futures.ThreadPoolExecutor(max_workers=limits.max_rpcs, thread_name_prefix="coordinator-rpc")
    server = grpc.server(
        pool,
        maximum_concurrent_rpcs=limits.max_rpcs,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_connection_idle_ms", int(limits.max_connection_idle_s * 1000)),
        ],
    )
    watch = StreamWatch(limits.stream_idle_s, limits.stream_max_s)
    _register(CoordinatorServicer(coordinator, auth, limits, watch), server, observer)
    health = Health(serving)
    health.register(server)
    if reflection:
        enable_reflection(server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    if bound == 0:
        watch.close()
        pool.shutdown(wait=False)
        raise OSError(f"could not bind the coordinator to {address}")
    server.start()
    return Server(server, watch, health, pool), bound
