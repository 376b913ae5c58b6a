"""Splitting named tensors into encoded chunks, and checking and reassembling them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from diloco.codec.base import Codec, CodecError, get_codec
from diloco.types import Chunk, TensorSpec

MAX_CHUNK_BYTES = 1 << 20  # the transport never sends a payload larger than 1 MiB


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_chunks(
    tensors: Mapping[str, torch.Tensor], *, codec: Codec, round: int, chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[Chunk]:
    """Yields chunks of every tensor in name order, each payload at most ``chunk_bytes``."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be in 1..{MAX_CHUNK_BYTES}")
    step = codec.max_chunk_numel(chunk_bytes)
    for name in sorted(tensors):
        t = tensors[name]
        flat = t.detach().reshape(-1)
        for offset in range(0, max(flat.numel(), 1), step):
            piece = flat[offset : offset + step]
            yield Chunk(
                name=name,
                shape=tuple(t.shape),
                dtype=dtype_name(t.dtype),
                offset=offset,
                numel=piece.numel(),
                codec=codec.name,
                payload=codec.encode(piece),
                round=round,
            )


def encoded_bytes(numels: Iterable[int], *, codec: Codec, chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """The payload bytes ``encode_chunks`` produces for tensors of these element counts:
    ``encoded_size`` chunk by chunk (exact, except an upper bound for +zstd codecs)."""
    step = codec.max_chunk_numel(chunk_bytes)
    total = 0
    for n in numels:
        for offset in range(0, max(n, 1), step):
            total += codec.encoded_size(min(step, n - offset))
    return total


class ChunkAssembler:
    """Decodes a stream of chunks into whole float32 tensors, checking every header.

    The expected tensors are given by their specs; each tensor must arrive exactly once,
    in order, with no gap or overlap. ``out`` (optional) holds preallocated buffers that
    the assembler fills in place, so a caller can reuse one staging area across pushes.
    Raises CodecError with a message naming the tensor and what was wrong.
    """

    def __init__(self, specs: Mapping[str, TensorSpec], out: dict[str, torch.Tensor] | None = None) -> None:
        self._specs = specs
        self._out = out if out is not None else {}
        self._next_offset: dict[str, int] = {}
        self.payload_bytes = 0

    def add(self, chunk: Chunk) -> None:
        spec = self._specs.get(chunk.name)
        if spec is None:
            raise CodecError(f"unknown parameter {chunk.name!r}")
        if tuple(chunk.shape) != spec.shape:
            raise CodecError(f"parameter {chunk.name!r} has shape {list(spec.shape)}, chunk declares {list(chunk.shape)}")
        if chunk.dtype != spec.dtype:
            raise CodecError(f"parameter {chunk.name!r} has dtype {spec.dtype}, chunk declares {chunk.dtype}")
        numel = _numel(spec.shape)
        expected = self._next_offset.get(chunk.name, 0)
        if chunk.offset != expected:
            raise CodecError(
                f"chunk of {chunk.name!r} starts at element {chunk.offset}, expected {expected} "
                "(chunks of a tensor must arrive once, in order, without gaps or overlaps)"
            )
        if chunk.numel < 0 or chunk.offset + chunk.numel > numel or (chunk.numel == 0 and numel > 0):
            raise CodecError(
                f"chunk of {chunk.name!r} covers elements [{chunk.offset}, {chunk.offset + chunk.numel}) "
                f"of a tensor with {numel}"
            )
        try:
            values = get_codec(chunk.codec).decode(chunk.payload, chunk.numel)
        except CodecError as e:
            raise CodecError(f"chunk of {chunk.name!r} at elements [{chunk.offset}, {chunk.offset + chunk.numel}): {e}") from None
        if not torch.isfinite(values).all():
            bad = int((~torch.isfinite(values)).sum())
            raise CodecError(f"non-finite values in {chunk.name!r}: {bad} of {chunk.numel} in this chunk")
        buf = self._out.get(chunk.name)
        if buf is None:
            buf = self._out[chunk.name] = torch.empty(spec.shape, dtype=torch.float32)
        buf.view(-1)[chunk.offset : chunk.offset + chunk.numel] = values
        self._next_offset[chunk.name] = chunk.offset + chunk.numel
        self.payload_bytes += len(chunk.payload)

    def finish(self) -> dict[str, torch.Tensor]:
        """The assembled tensors; CodecError if any expected tensor is missing or incomplete."""
        missing = [n for n in sorted(self._specs) if self._next_offset.get(n, -1) != _numel(self._specs[n].shape)]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CodecError(f"incomplete: {len(missing)} parameter(s) missing or partial: {shown}{more}")
        return {n: self._out[n] for n in self._specs}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
