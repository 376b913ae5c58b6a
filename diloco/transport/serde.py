"""The one place where protobuf messages and domain types are converted, in pairs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco.boxes import Box
from diloco.sync import parse_stated
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec

# PullUpdate with wait_s > 0: the initial metadata says whether the round was committed in time.
COMMITTED_KEY = "diloco-committed"


def spec_to_proto(s: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)


def spec_from_proto(m: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(name=m.name, shape=tuple(m.shape), dtype=m.dtype)


def chunk_to_proto(c: Chunk) -> pb.TensorChunk:
    return pb.TensorChunk(
        name=c.name, shape=list(c.shape), dtype=c.dtype, offset=c.offset, numel=c.numel, codec=c.codec, payload=c.payload,
        box_start=list(c.box_start), box_shape=list(c.box_shape),
    )  # fmt: skip


# ---- chunks straight to their wire bytes ---------------------------------------------------
# The coordinator sends every chunk of an update to every site: building a pb.TensorChunk and
# serializing it copies the payload twice and costs Python objects per chunk. These write the
# bytes SerializeToString would (field order, proto3's omitted defaults, packed repeated
# int64; tests/unit check them byte for byte), with one copy of the payload.


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _text(tag: int, text: str) -> bytes:
    raw = text.encode()
    return bytes((tag,)) + _varint(len(raw)) + raw if raw else b""


def _packed(tag: int, values: tuple[int, ...]) -> bytes:
    if not values:
        return b""
    packed = b"".join(_varint(int(v)) for v in values)
    return bytes((tag,)) + _varint(len(packed)) + packed


def _chunk_fields(c: Chunk) -> tuple[bytes, bytes, bytes]:
    """The TensorChunk wire bytes of ``c`` as (before the payload, the payload, after it):
    fields 1-7 in order (the payload last of them), then 9 and 10."""
    head = b"".join((
        _text(0x0A, c.name), _packed(0x12, c.shape), _text(0x1A, c.dtype),
        b"\x20" + _varint(int(c.offset)) if c.offset else b"", b"\x28" + _varint(int(c.numel)) if c.numel else b"",
        _text(0x32, c.codec), b"\x3a" + _varint(len(c.payload)) if c.payload else b"",
    ))  # fmt: skip
    return head, c.payload, _packed(0x4A, c.box_start) + _packed(0x52, c.box_shape)


def chunk_to_wire(c: Chunk) -> bytes:
    """``chunk_to_proto(c).SerializeToString()``, faster."""
    return b"".join(_chunk_fields(c))


def global_chunk_to_wire(c: Chunk) -> bytes:
    """``pb.GlobalMessage(chunk=chunk_to_proto(c)).SerializeToString()``, faster."""
    return _global_message(b"\x12", c)


def push_chunk_to_wire(c: Chunk) -> bytes:
    """``pb.PushMessage(chunk=chunk_to_proto(c)).SerializeToString()``, faster: a site's pushed
    chunk with one copy of its payload (protobuf's way copies it into the chunk message, into
    the push message and into the bytes), in the canonical form the server reads without
    protobuf (``push_message_from_wire``)."""
    return _global_message(b"\x12", c)


def push_message_to_wire(m: Chunk | pb.PushMessage) -> bytes:
    """A push stream's message: a Chunk as ``push_chunk_to_wire`` writes it, the header (a
    PushMessage) as protobuf does."""
    return push_chunk_to_wire(m) if isinstance(m, Chunk) else m.SerializeToString()


@dataclass(frozen=True)
class MomentumChunk:
    """A chunk of the outer optimizer's momentum in a PullGlobal answer (GlobalMessage.momentum)."""

    chunk: Chunk


def momentum_chunk_to_wire(m: MomentumChunk) -> bytes:
    """``pb.GlobalMessage(momentum=chunk_to_proto(m.chunk)).SerializeToString()``, faster."""
    return _global_message(b"\x1a", m.chunk)


def _global_message(tag: bytes, c: Chunk) -> bytes:
    head, payload, tail = _chunk_fields(c)
    return b"".join((tag, _varint(len(head) + len(payload) + len(tail)), head, payload, tail))


# ---- pushed chunks straight from their wire bytes -------------------------------------------
# A push arrives as one PushMessage per chunk. Parsing it with protobuf copies the payload into
# the message and again into a Python bytes object, and builds objects per field; the common
# message, a chunk as SerializeToString writes it, is read here instead: the payload comes out
# as a view of the received bytes. Anything else (the header, fields out of order, repeated,
# unpacked or unknown, bad UTF-8: all legal protobuf or errors protobuf must name) goes to
# protobuf's own parser, so every message means exactly what it meant before.

_STRING_TAGS = {0x0A: "name", 0x1A: "dtype", 0x32: "codec"}
_PACKED_TAGS = {0x12: "shape", 0x4A: "box_start", 0x52: "box_shape"}
_INT_TAGS = {0x20: "offset", 0x28: "numel"}
_ORDER = (0x0A, 0x12, 0x1A, 0x20, 0x28, 0x32, 0x3A, 0x4A, 0x52)


def _read_varint(data: memoryview, at: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    for i in range(at, min(end, at + 10)):
        b = data[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return (value if value < 1 << 64 else None), i + 1  # type: ignore[return-value]
        shift += 7
    return None


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _canonical_chunk(data: bytes) -> Chunk | None:
    """The chunk of a PushMessage written as SerializeToString writes one, else None."""
    view = memoryview(data)
    if len(view) < 2 or view[0] != 0x12:
        return None
    got = _read_varint(view, 1, len(view))
    if got is None or got[1] + got[0] != len(view):
        return None
    at, end = got[1], len(view)
    fields: dict[str, Any] = {}
    order = iter(_ORDER)
    while at < end:
        tag = view[at]
        if tag not in _ORDER or not any(t == tag for t in order):  # unknown, repeated or out of order
            return None
        at += 1
        if tag in _INT_TAGS:
            got = _read_varint(view, at, end)
            if got is None:
                return None
            fields[_INT_TAGS[tag]], at = _int64(got[0]), got[1]
            continue
        got = _read_varint(view, at, end)
        if got is None or got[1] + got[0] > end:
            return None
        start, at = got[1], got[1] + got[0]
        if tag == 0x3A:
            fields["payload"] = view[start:at]
        elif tag in _STRING_TAGS:
            try:
                fields[_STRING_TAGS[tag]] = str(view[start:at], "utf-8")
            except UnicodeDecodeError:
                return None
        else:
            values, i = [], start
            while i < at:
                got = _read_varint(view, i, at)
                if got is None:
                    return None
                values.append(_int64(got[0]))
                i = got[1]
            fields[_PACKED_TAGS[tag]] = tuple(values)
    return Chunk(
        name=fields.get("name", ""), shape=fields.get("shape", ()), dtype=fields.get("dtype", ""), offset=fields.get("offset", 0), numel=fields.get("numel", 0),
        codec=fields.get("codec", ""), payload=fields.get("payload", b""), box_start=fields.get("box_start", ()), box_shape=fields.get("box_shape", ()),
    )  # fmt: skip


def push_message_from_wire(data: bytes) -> Chunk | pb.PushMessage:
    """A PushMessage: a domain Chunk when it holds a chunk in canonical form (its payload a
    view of ``data``), else protobuf's parse of it (``pb.PushMessage.FromString``)."""
    return _canonical_chunk(data) or pb.PushMessage.FromString(data)


def chunk_from_proto(m: pb.TensorChunk) -> Chunk:
    return Chunk(
        name=m.name, shape=tuple(m.shape), dtype=m.dtype, offset=m.offset, numel=m.numel, codec=m.codec, payload=m.payload,
        box_start=tuple(m.box_start), box_shape=tuple(m.box_shape),
    )  # fmt: skip


def eval_fields(e: SiteEval | None) -> dict[str, float | int]:
    """The eval_loss / eval_tokens / eval_round fields of PushHeader and LeaveRequest."""
    return {} if e is None else {"eval_loss": e.loss, "eval_tokens": e.tokens, "eval_round": e.round}


def eval_from_proto(m: pb.PushHeader | pb.LeaveRequest) -> SiteEval | None:
    return SiteEval(round=m.eval_round, loss=m.eval_loss, tokens=m.eval_tokens) if m.eval_tokens else None


def header_to_proto(h: PushHeader) -> pb.PushHeader:
    return pb.PushHeader(
        site_id=h.site_id, round=h.round, tokens=h.tokens, train_loss=h.train_loss, inner_steps=h.inner_steps, part=h.part, parts=h.parts,
        withheld=h.withheld, **eval_fields(h.eval),
    )  # fmt: skip


def header_from_proto(m: pb.PushHeader) -> PushHeader:
    return PushHeader(
        site_id=m.site_id, round=m.round, tokens=m.tokens, train_loss=m.train_loss, inner_steps=m.inner_steps, part=m.part, parts=m.parts or 1,
        eval=eval_from_proto(m), withheld=m.withheld,
    )  # fmt: skip


def join_request_to_proto(j: JoinRequest) -> pb.JoinRequest:
    return pb.JoinRequest(
        site_id=j.site_id,
        params=[spec_to_proto(s) for s in j.specs],
        can_upload=j.can_upload,
        stated=json.dumps(dict(j.stated), sort_keys=True) if j.stated else "",
    )


def join_request_from_proto(m: pb.JoinRequest) -> JoinRequest:
    """ValueError (the caller refuses the call as invalid_argument) for stated settings that
    are not a JSON object of dotted keys, or too long."""
    return JoinRequest(
        site_id=m.site_id,
        specs=tuple(spec_from_proto(s) for s in m.params),
        can_upload=m.can_upload,
        stated=parse_stated(m.stated),
    )


def boxes_to_proto(want: Mapping[str, Box] | None) -> list[pb.TensorBox]:
    return [pb.TensorBox(name=n, start=list(b.start), shape=list(b.shape)) for n, b in sorted((want or {}).items())]


def boxes_from_proto(want: Iterable[pb.TensorBox]) -> dict[str, Box] | None:
    boxes = {m.name: Box(tuple(m.start), tuple(m.shape)) for m in want}
    return boxes or None


def push_result_to_proto(r: PushResult) -> pb.PushReply:
    return pb.PushReply(
        accepted=r.accepted,
        duplicate=r.duplicate,
        round=r.round,
        payload_bytes=r.payload_bytes,
        merged_into=r.merged_into,
        refused=r.refused,
        clipped=r.clipped,
    )


def push_result_from_proto(m: pb.PushReply) -> PushResult:
    return PushResult(
        accepted=m.accepted,
        duplicate=m.duplicate,
        round=m.round,
        payload_bytes=m.payload_bytes,
        merged_into=m.merged_into,
        refused=m.refused,
        clipped=m.clipped,
    )


def join_info_to_proto(j: JoinInfo) -> pb.JoinReply:
    return pb.JoinReply(
        total_rounds=j.total_rounds,
        run_id=j.run_id,
        lease_s=j.lease_s,
        upload_init=j.upload_init,
        eval_every=j.eval_every,
        settings=json.dumps(dict(j.settings), sort_keys=True) if j.settings is not None else "",
        fragments=[pb.Fragment(names=list(f)) for f in j.fragments],
    )


def join_info_from_proto(m: pb.JoinReply) -> JoinInfo:
    return JoinInfo(
        total_rounds=m.total_rounds,
        run_id=m.run_id,
        lease_s=m.lease_s,
        upload_init=m.upload_init,
        eval_every=m.eval_every,
        settings=json.loads(m.settings) if m.settings else None,
        fragments=tuple(tuple(f.names) for f in m.fragments),
    )


def status_to_proto(s: RoundStatus) -> pb.RoundStatus:
    return pb.RoundStatus(committed_rounds=s.committed_rounds, total_rounds=s.total_rounds, global_sha256=s.global_sha256)


def status_from_proto(m: pb.RoundStatus) -> RoundStatus:
    return RoundStatus(committed_rounds=m.committed_rounds, total_rounds=m.total_rounds, global_sha256=m.global_sha256)
