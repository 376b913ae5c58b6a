"""The one place where protobuf messages and domain types are converted, in pairs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from diloco.boxes import Box
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.types import Chunk, JoinInfo, PushHeader, PushResult, RoundStatus, TensorSpec


def spec_to_proto(s: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)


def spec_from_proto(m: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(name=m.name, shape=tuple(m.shape), dtype=m.dtype)


def chunk_to_proto(c: Chunk) -> pb.TensorChunk:
    return pb.TensorChunk(
        name=c.name, shape=list(c.shape), dtype=c.dtype, offset=c.offset, numel=c.numel, codec=c.codec, payload=c.payload, round=c.round,
        box_start=list(c.box_start), box_shape=list(c.box_shape),
    )  # fmt: skip


def chunk_from_proto(m: pb.TensorChunk) -> Chunk:
    return Chunk(
        name=m.name, shape=tuple(m.shape), dtype=m.dtype, offset=m.offset, numel=m.numel, codec=m.codec, payload=m.payload, round=m.round,
        box_start=tuple(m.box_start), box_shape=tuple(m.box_shape),
    )  # fmt: skip


def header_to_proto(h: PushHeader) -> pb.PushHeader:
    return pb.PushHeader(site_id=h.site_id, round=h.round, tokens=h.tokens, train_loss=h.train_loss, inner_steps=h.inner_steps, part=h.part, parts=h.parts)


def header_from_proto(m: pb.PushHeader) -> PushHeader:
    return PushHeader(
        site_id=m.site_id, round=m.round, tokens=m.tokens, train_loss=m.train_loss, inner_steps=m.inner_steps, part=m.part, parts=m.parts or 1
    )


def boxes_to_proto(want: Mapping[str, Box] | None) -> list[pb.TensorBox]:
    return [pb.TensorBox(name=n, start=list(b.start), shape=list(b.shape)) for n, b in sorted((want or {}).items())]


def boxes_from_proto(want: Iterable[pb.TensorBox]) -> dict[str, Box] | None:
    boxes = {m.name: Box(tuple(m.start), tuple(m.shape)) for m in want}
    return boxes or None


def push_result_to_proto(r: PushResult) -> pb.PushReply:
    return pb.PushReply(accepted=r.accepted, duplicate=r.duplicate, round=r.round, payload_bytes=r.payload_bytes, merged_into=r.merged_into)


def push_result_from_proto(m: pb.PushReply) -> PushResult:
    return PushResult(accepted=m.accepted, duplicate=m.duplicate, round=m.round, payload_bytes=m.payload_bytes, merged_into=m.merged_into)


def join_info_to_proto(j: JoinInfo) -> pb.JoinReply:
    return pb.JoinReply(open_round=j.open_round, total_rounds=j.total_rounds, run_id=j.run_id, lease_s=j.lease_s)


def join_info_from_proto(m: pb.JoinReply) -> JoinInfo:
    return JoinInfo(open_round=m.open_round, total_rounds=m.total_rounds, run_id=m.run_id, lease_s=m.lease_s)


def status_to_proto(s: RoundStatus) -> pb.RoundStatus:
    return pb.RoundStatus(committed_rounds=s.committed_rounds, open_round=s.open_round, total_rounds=s.total_rounds, global_sha256=s.global_sha256)


def status_from_proto(m: pb.RoundStatus) -> RoundStatus:
    return RoundStatus(committed_rounds=m.committed_rounds, open_round=m.open_round, total_rounds=m.total_rounds, global_sha256=m.global_sha256)
