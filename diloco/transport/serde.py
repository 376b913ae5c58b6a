"""The one place where protobuf messages and domain types are converted, in pairs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from diloco.boxes import Box
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval, TensorSpec


def spec_to_proto(s: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)


def spec_from_proto(m: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(name=m.name, shape=tuple(m.shape), dtype=m.dtype)


def chunk_to_proto(c: Chunk) -> pb.TensorChunk:
    return pb.TensorChunk(
        name=c.name, shape=list(c.shape), dtype=c.dtype, offset=c.offset, numel=c.numel, codec=c.codec, payload=c.payload,
        box_start=list(c.box_start), box_shape=list(c.box_shape),
    )  # fmt: skip


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
        **eval_fields(h.eval),
    )  # fmt: skip


def header_from_proto(m: pb.PushHeader) -> PushHeader:
    return PushHeader(
        site_id=m.site_id, round=m.round, tokens=m.tokens, train_loss=m.train_loss, inner_steps=m.inner_steps, part=m.part, parts=m.parts or 1,
        eval=eval_from_proto(m),
    )  # fmt: skip


def join_request_to_proto(j: JoinRequest) -> pb.JoinRequest:
    return pb.JoinRequest(site_id=j.site_id, params=[spec_to_proto(s) for s in j.specs], can_upload=j.can_upload, sync_every=j.sync_every, codec=j.codec, fragments=j.fragments)


def join_request_from_proto(m: pb.JoinRequest) -> JoinRequest:
    return JoinRequest(site_id=m.site_id, specs=tuple(spec_from_proto(s) for s in m.params), can_upload=m.can_upload, sync_every=m.sync_every, codec=m.codec, fragments=m.fragments)


def boxes_to_proto(want: Mapping[str, Box] | None) -> list[pb.TensorBox]:
    return [pb.TensorBox(name=n, start=list(b.start), shape=list(b.shape)) for n, b in sorted((want or {}).items())]


def boxes_from_proto(want: Iterable[pb.TensorBox]) -> dict[str, Box] | None:
    boxes = {m.name: Box(tuple(m.start), tuple(m.shape)) for m in want}
    return boxes or None


def push_result_to_proto(r: PushResult) -> pb.PushReply:
    return pb.PushReply(
        accepted=r.accepted, duplicate=r.duplicate, round=r.round, payload_bytes=r.payload_bytes, merged_into=r.merged_into, refused=r.refused, clipped=r.clipped
    )


def push_result_from_proto(m: pb.PushReply) -> PushResult:
    return PushResult(
        accepted=m.accepted, duplicate=m.duplicate, round=m.round, payload_bytes=m.payload_bytes, merged_into=m.merged_into, refused=m.refused, clipped=m.clipped
    )


def join_info_to_proto(j: JoinInfo) -> pb.JoinReply:
    return pb.JoinReply(total_rounds=j.total_rounds, run_id=j.run_id, lease_s=j.lease_s, upload_init=j.upload_init, eval_every=j.eval_every)


def join_info_from_proto(m: pb.JoinReply) -> JoinInfo:
    return JoinInfo(total_rounds=m.total_rounds, run_id=m.run_id, lease_s=m.lease_s, upload_init=m.upload_init, eval_every=m.eval_every)


def status_to_proto(s: RoundStatus) -> pb.RoundStatus:
    return pb.RoundStatus(committed_rounds=s.committed_rounds, total_rounds=s.total_rounds, global_sha256=s.global_sha256)


def status_from_proto(m: pb.RoundStatus) -> RoundStatus:
    return RoundStatus(committed_rounds=m.committed_rounds, total_rounds=m.total_rounds, global_sha256=m.global_sha256)
