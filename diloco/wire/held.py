"""A push kept as it arrived, for the coordinator's fused intake: every chunk checked as it
comes (its header, its place in its tensor, and that each value it decodes to is finite),
then, once the push is whole and counted, added into the round's float64 sum chunk by chunk
straight from the payload (``accumulate``): no float32 copy of the push is ever made.

Chunks of whole tensors whose codec has the fused pair (``check_payload`` and
``accumulate``: fp32, int8, int4, e3m0) keep their payloads; topk2bit's keep their kept
values and positions (``decode_sparse``), added where they go; a chunk of another codec, or of a slice (a
box) of a tensor, is decoded as it arrives and its float32 values are kept instead. The memory a push holds is what it sent (its
payloads: one byte per value in int8, against the four of a float32 staging copy).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.boxes import Box
from diloco.codec.base import CodecError, get_codec
from diloco.types import Chunk, TensorSpec
from diloco.wire.bundles import is_bundle
from diloco.wire.chunks import _Arrivals, _decode, unbundled


class HeldPush:
    """The chunks of one push of whole tensors, checked and kept until ``accumulate_into``.

    ``add`` raises CodecError naming the chunk and what was wrong; ``finish`` raises it when a
    tensor is missing or partial. Nothing is written anywhere before ``accumulate_into``, so a
    push refused half-way leaves no trace."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self._specs = specs
        self._arrivals = _Arrivals(specs, "that arrived before")
        self._kept: list[tuple[str, int, int, object, bytes | torch.Tensor]] = []  # name, offset, numel, codec, payload or values
        self._boxes: dict[tuple[str, Box], torch.Tensor] = {}  # a slice's values, filled as its chunks come
        self.payload_bytes = 0

    def add(self, chunk: Chunk) -> None:
        if is_bundle(chunk):
            for c in unbundled([chunk]):
                self.add(c)
            return
        spec, box = self._arrivals.check(chunk)
        codec = _codec(chunk)
        if not box.is_whole(spec.shape):
            part = self._boxes.setdefault((chunk.name, box), torch.empty(box.numel, dtype=torch.float32))
            part[chunk.offset : chunk.offset + chunk.numel] = _decode(chunk)
        elif hasattr(codec, "decode_sparse"):
            try:
                positions, values = codec.decode_sparse(chunk.payload, chunk.numel)
            except CodecError as e:
                raise CodecError(f"chunk of {chunk.name!r} at elements [{chunk.offset}, {chunk.offset + chunk.numel}): {e}") from None
            # finite: its levels are (decode_sparse refuses others)
            self._kept.append((chunk.name, chunk.offset, chunk.numel, codec, (positions, values)))
        elif hasattr(codec, "accumulate"):
            try:
                codec.check_payload(chunk.payload, chunk.numel)
            except CodecError as e:
                raise CodecError(f"chunk of {chunk.name!r} at elements [{chunk.offset}, {chunk.offset + chunk.numel}): {e}") from None
            kept: bytes | torch.Tensor = chunk.payload
            self._kept.append((chunk.name, chunk.offset, chunk.numel, codec, kept))
        else:
            kept = _decode(chunk)
            self._kept.append((chunk.name, chunk.offset, chunk.numel, codec, kept))
        self.payload_bytes += len(chunk.payload)

    def finish(self) -> HeldPush:
        """Itself, once every tensor is complete; CodecError naming those that are not."""
        problems = self._arrivals.problems()
        if problems:
            shown = "; ".join(problems[:5])
            more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise CodecError(f"incomplete: {len(problems)} parameter(s) missing, partial or with gaps: {shown}{more}")
        return self

    def accumulate_into(self, sums: Mapping[str, torch.Tensor], alpha: float) -> None:
        """``sums[name] += alpha * values`` (float64, contiguous) for every chunk kept of a
        tensor ``sums`` has (a shard of the coordinator takes its own range of a push)."""
        for name, offset, numel, codec, kept in self._kept:
            if name not in sums:
                continue
            out = sums[name].view(-1)[offset : offset + numel]
            if isinstance(kept, torch.Tensor):
                out.add_(kept, alpha=alpha)
            elif isinstance(kept, tuple):
                codec.add_sparse(*kept, out, alpha)  # type: ignore[attr-defined]
            else:
                codec.accumulate(kept, numel, out, alpha)  # type: ignore[attr-defined]
        for (name, box), values in self._boxes.items():
            if name in sums:
                sums[name][box.slices()].add_(values.view(box.shape), alpha=alpha)


def _codec(chunk: Chunk) -> object:
    try:
        return get_codec(chunk.codec)
    except CodecError as e:
        raise CodecError(f"chunk of {chunk.name!r} at elements [{chunk.offset}, {chunk.offset + chunk.numel}): {e}") from None
