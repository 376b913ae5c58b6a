"""Bundles: several small chunks carried as one, so that a model of many small tensors does not
cost one gRPC message per tensor.

A stream message costs a fixed ~0.1-0.3 ms in Python's gRPC at each end (thread hand-offs per
message), whatever it carries: the 38 tensors of a 0.84M-parameter model took ~38 messages
each way per round, most of them a few KiB. A bundle is a chunk with ``codec == "bundle"``
(its name, dtype and shape empty, ``numel`` the number of chunks it holds) whose payload packs
whole chunks, each checked on arrival exactly as if it had come alone: a receiver unpacks it
(``diloco.wire.unbundled``) before anything else looks at a chunk. The payload stays within the 1 MiB a
chunk may carry. Bytes are counted as the payloads of the chunks inside (framing excluded, as
before).

Payload layout (little-endian): ``b"DLBN"``, ``count:u32``, then per chunk ``meta_len:u32``,
the meta, ``payload_len:u32``, the payload. The meta: ``name`` (u16 length + UTF-8),
``dtype`` and ``codec`` (u8 length + UTF-8 each), ``offset:u64``, ``numel:u64``, then
``shape``, ``box_start`` and ``box_shape`` (each u8 count + u64 values). Every length is
checked against what is left before anything is read; a bundle inside a bundle is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from diloco.codec.base import CodecError
from diloco.types import Chunk

BUNDLE_CODEC = "bundle"
MAGIC = b"DLBN"
# Fewer chunks than this go as they are: bundling pays for itself only over many messages (and
# a short stream of plain chunks stays readable by any receiver).
MIN_CHUNKS = 8
_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))
_HEAD = struct.Struct("<4sI")
_MAX_DIMS = 255


def is_bundle(chunk: Chunk) -> bool:
    return chunk.codec == BUNDLE_CODEC


def _meta(c: Chunk) -> bytes:
    name, dtype, codec = c.name.encode(), c.dtype.encode(), c.codec.encode()
    if len(name) > 0xFFFF or len(dtype) > 0xFF or len(codec) > 0xFF or max(len(c.shape), len(c.box_start), len(c.box_shape)) > _MAX_DIMS:
        raise ValueError(f"chunk of {c.name[:80]!r} cannot be bundled (a name or shape too long)")
    parts = [_U16.pack(len(name)), name, _U8.pack(len(dtype)), dtype, _U8.pack(len(codec)), codec, _U64.pack(c.offset), _U64.pack(c.numel)]
    for dims in (c.shape, c.box_start, c.box_shape):
        parts.append(_U8.pack(len(dims)))
        parts.extend(_U64.pack(int(d)) for d in dims)
    return b"".join(parts)


def _framed(c: Chunk) -> list[bytes]:
    meta = _meta(c)
    return [_U32.pack(len(meta)), meta, _U32.pack(len(c.payload)), c.payload]


def bundle_chunks(chunks: Iterable[Chunk], max_bytes: int, min_chunks: int = MIN_CHUNKS) -> list[Chunk]:
    """``chunks`` with runs of consecutive small ones packed into bundles of at most
    ``max_bytes`` payload, in order; a chunk too large to share a bundle goes alone, as it is.
    Fewer than ``min_chunks`` chunks are returned as they are."""
    chunks = list(chunks)
    if len(chunks) < min_chunks or any(is_bundle(c) for c in chunks):
        return chunks
    out: list[Chunk] = []
    run: list[Chunk] = []
    pieces: list[bytes] = []
    size = _HEAD.size

    def flush() -> None:
        nonlocal size
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(
                Chunk(name="", shape=(), dtype="", offset=0, numel=len(run), codec=BUNDLE_CODEC, payload=b"".join([_HEAD.pack(MAGIC, len(run)), *pieces]))
            )
        run.clear()
        pieces.clear()
        size = _HEAD.size

    for c in chunks:
        framed = _framed(c)
        n = sum(len(p) for p in framed)
        if _HEAD.size + n > max_bytes:  # cannot share a bundle
            flush()
            out.append(c)
            continue
        if size + n > max_bytes:
            flush()
        run.append(c)
        pieces.extend(framed)
        size += n
    flush()
    return out


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data, self.at = memoryview(data), 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self._data) - self.at:
            raise CodecError(f"bundle: {what} ({n} bytes) runs past the end of the payload ({len(self._data) - self.at} bytes left)")
        piece = self._data[self.at : self.at + n]
        self.at += n
        return piece

    def unpack(self, fmt: struct.Struct, what: str) -> int:
        return fmt.unpack(self.take(fmt.size, what))[0]

    def text(self, fmt: struct.Struct, what: str) -> str:
        raw = self.take(self.unpack(fmt, f"the length of {what}"), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise CodecError(f"bundle: {what} is not UTF-8") from None

    def dims(self, what: str) -> tuple[int, ...]:
        n = self.unpack(_U8, f"the length of {what}")
        return tuple(self.unpack(_U64, what) for _ in range(n))

    def left(self) -> int:
        return len(self._data) - self.at


def unbundle(bundle: Chunk) -> Iterator[Chunk]:
    """The chunks a bundle holds, in order, their payloads views of the bundle's (read-only
    memoryviews: every decoder reads bytes-like objects); CodecError (naming what is wrong) for
    a payload that does not parse, a count that disagrees, or a bundle inside it. Plain chunks
    are not bundles: the caller checks ``is_bundle`` first."""
    r = _Reader(bundle.payload)
    magic, count = _HEAD.unpack(r.take(_HEAD.size, "the bundle header"))
    if magic != MAGIC:
        raise CodecError(f"bundle payload starts with {bytes(magic)!r}, not {MAGIC!r}")
    if count != bundle.numel or count < 1:
        raise CodecError(f"bundle holds {count} chunk(s), the chunk declares {bundle.numel}")
    if bundle.name or bundle.dtype or bundle.shape or bundle.offset or bundle.box_start or bundle.box_shape:
        raise CodecError("a bundle chunk carries no name, dtype, shape, offset or box of its own")
    for i in range(count):
        meta = _Reader(r.take(r.unpack(_U32, f"the length of chunk {i}'s header"), f"chunk {i}'s header"))
        name = meta.text(_U16, "a name")
        dtype = meta.text(_U8, "a dtype")
        codec = meta.text(_U8, "a codec name")
        offset = meta.unpack(_U64, "an offset")
        numel = meta.unpack(_U64, "an element count")
        shape, box_start, box_shape = meta.dims("a shape"), meta.dims("a box start"), meta.dims("a box shape")
        if meta.left():
            raise CodecError(f"bundle: chunk {i}'s header has {meta.left()} bytes too many")
        if codec == BUNDLE_CODEC:
            raise CodecError("a bundle inside a bundle")
        payload = r.take(r.unpack(_U32, f"the length of chunk {i}'s payload"), f"chunk {i}'s payload")  # a view: no copy
        yield Chunk(name=name, shape=shape, dtype=dtype, offset=offset, numel=numel, codec=codec, payload=payload, box_start=box_start, box_shape=box_shape)
    if r.left():
        raise CodecError(f"bundle: {r.left()} bytes after its {count} chunk(s)")
