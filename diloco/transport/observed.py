"""The server's calls, as an observer sees them: each call's method, outcome and duration, and
the bytes of every message in and out (what the coordinator's Prometheus metrics count). The
observer is any object with these methods, so the transport depends on no metrics library.

Outcomes: ``ok``; ``duplicate`` (a push the coordinator had already: accepted, not counted
again); or the gRPC status the call ended with, in lower case (``aborted``: a push for a round
that closed without it; ``unauthenticated``, ``resource_exhausted``, ``cancelled``, ...).
Calls that grpc refuses before any handler runs (over ``max_rpcs``) are not seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc


class CallObserver(Protocol):
    def call_done(self, method: str, outcome: str, seconds: float) -> None:
        """A call of ``method`` (the service's method name, e.g. ``PushDelta``) ended."""

    def bytes_received(self, method: str, n: int) -> None:
        """A request message of ``n`` bytes (serialized, before decoding) arrived."""

    def bytes_sent(self, method: str, n: int) -> None:
        """A response message of ``n`` bytes (serialized) went out."""


def _outcome(context: grpc.ServicerContext, failed: bool) -> str:
    code = context.code()
    if code is None or code == grpc.StatusCode.OK:
        if failed:
            return "cancelled" if not context.is_active() else "unknown"
        return "ok"
    return str(code.name).lower()


def _reply_outcome(reply: Any) -> str:
    return "duplicate" if getattr(reply, "duplicate", False) else "ok"


def observe_handler(method: str, handler: grpc.RpcMethodHandler, observer: CallObserver) -> grpc.RpcMethodHandler:
    """``handler`` with its call outcome, duration and message sizes told to ``observer``."""
    deserialize, serialize = handler.request_deserializer, handler.response_serializer

    def read(data: bytes) -> Any:
        observer.bytes_received(method, len(data))
        return deserialize(data) if deserialize is not None else data

    def write(message: Any) -> bytes:
        data = serialize(message) if serialize is not None else message
        observer.bytes_sent(method, len(data))
        return data

    def unary_reply(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            t0, failed, outcome = time.perf_counter(), True, None
            try:
                reply = behavior(request, context)
                failed, outcome = False, _reply_outcome(reply)
                return reply
            finally:
                observer.call_done(method, outcome if outcome is not None and context.code() is None else _outcome(context, failed), time.perf_counter() - t0)

        return call

    def streamed_reply(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            t0, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                observer.call_done(method, _outcome(context, failed), time.perf_counter() - t0)

        return call

    changes: dict[str, Any] = {"request_deserializer": read, "response_serializer": write}
    for kind, wrap in (("unary_unary", unary_reply), ("stream_unary", unary_reply), ("unary_stream", streamed_reply), ("stream_stream", streamed_reply)):
        behavior = getattr(handler, kind)
        if behavior is not None:
            changes[kind] = wrap(behavior)
    return handler._replace(**changes)
