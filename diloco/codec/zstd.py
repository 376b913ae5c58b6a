"""zstd as an optional last stage after any codec, with a byte-plane shuffle for floats."""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from diloco.codec.base import Codec, CodecError
from diloco.codec.header import MAGIC, MAX_NUMEL, VERSION, largest_fitting

_HEADER = struct.Struct("<BBBB")  # magic, version, byte-plane width (1 = no shuffle), 0
_MIN_LEVEL = -(1 << 17)  # ZSTD_minCLevel(): the fastest of zstd's negative levels
# The most content one byte of a zstd frame can stand for: a block holds at most 128 KiB and
# takes at least 4 bytes (an RLE block: a 3-byte header and the repeated byte).
_MAX_RATIO = (128 << 10) // 4
_EMPTY_LAST_BLOCK = b"\x01\x00\x00"  # what zstd writes after the header of a frame of no content


def compress_bound(n: int) -> int:
    """The largest zstd frame for n input bytes (ZSTD_COMPRESSBOUND in zstd.h)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


def _shuffle(data: bytes, start: int, width: int) -> bytes:
    """Bytes [start:] regrouped so byte 0 of every element comes first, then byte 1, ...:
    float exponents and sign bytes become long runs zstd compresses well."""
    planes = np.frombuffer(data, dtype=np.uint8, offset=start).reshape(-1, width).T
    return data[:start] + planes.tobytes()


def _unshuffle(data: bytes, start: int, width: int) -> bytes:
    elements = np.frombuffer(data, dtype=np.uint8, offset=start).reshape(width, -1).T
    return data[:start] + elements.tobytes()


class ZstdCodec:
    """``inner`` followed by zstd; named ``inner.name + "+zstd"``.

    Layout: 4-byte header (magic 0x5A, version 1, byte-plane width, 0) + one zstd frame of
    the inner payload, which records its content size. For fp32 / fp16 / bf16 the inner
    payload's float section is byte-plane shuffled first (width 4 or 2; its header stays in
    front); other codecs' payloads are compressed as they are (width 1).
    Size: at most 4 + compress_bound(inner.encoded_size(numel)) bytes (zstd can expand
    incompressible input slightly). The decoder never inflates past
    inner.max_encoded_size(numel), nor past 32768 bytes per frame byte (zstd's largest
    ratio): a frame that declares or produces more is rejected before that memory is
    allocated. numel is at most 2**32 - 1 (the inner header's u32). The level only affects
    the encoder; default 3.
    """

    def __init__(self, inner: Codec, level: int = 3) -> None:
        if not _MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd level={level} must be in {_MIN_LEVEL}..{zstandard.MAX_COMPRESSION_LEVEL} (negative: faster)")
        self.inner = inner
        self.level = level
        self.name = f"{inner.name}+zstd"
        self._start, self._width = getattr(inner, "byte_planes", (0, 1))

    def __repr__(self) -> str:
        return f"ZstdCodec({self.inner!r}, level={self.level})"

    def encoded_size(self, numel: int) -> int:
        return _HEADER.size + compress_bound(self.inner.encoded_size(numel))

    def max_encoded_size(self, numel: int) -> int:
        return _HEADER.size + compress_bound(self.inner.max_encoded_size(numel))

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        multiple = getattr(self.inner, "block", 1)
        return largest_fitting(self.encoded_size, chunk_bytes, multiple=multiple)

    def encode(self, flat: torch.Tensor) -> bytes:
        data = self.inner.encode(flat)
        if self._width > 1:
            data = _shuffle(data, self._start, self._width)
        # A fresh compressor per call: codecs are shared between threads and a
        # ZstdCompressor is not thread-safe.
        frame = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data)
        return _HEADER.pack(MAGIC["zstd"], VERSION, self._width, 0) + frame

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        if not 0 <= numel <= MAX_NUMEL:
            raise CodecError(f"{self.name}: element count {numel} outside 0..{MAX_NUMEL}")
        if len(payload) < _HEADER.size:
            raise CodecError(f"{self.name} payload has {len(payload)} bytes, shorter than its {_HEADER.size}-byte header")
        magic, version, width, reserved = _HEADER.unpack_from(payload)
        if magic != MAGIC["zstd"]:
            raise CodecError(f"{self.name} payload starts with magic byte 0x{magic:02x}, expected 0x{MAGIC['zstd']:02x}")
        if version != VERSION:
            raise CodecError(f"{self.name} payload has layout version {version}; this decoder reads version {VERSION}")
        if width != self._width or reserved:
            raise CodecError(f"{self.name} payload header declares byte-plane width {width} (reserved {reserved}), expected {self._width} (0)")
        data = self._inflate(memoryview(payload)[_HEADER.size :], numel)
        if self._width > 1:
            if (len(data) - self._start) % self._width or len(data) < self._start:
                raise CodecError(f"{self.name}: inflated payload of {len(data)} bytes is not whole {self._width}-byte elements")
            data = _unshuffle(data, self._start, self._width)
        return self.inner.decode(data, numel)

    def _inflate(self, frame: memoryview, numel: int) -> bytes:
        # Never more than a valid inner payload of numel elements, nor than this frame can
        # hold: zstd allocates a declared content size before it inflates anything.
        limit = min(self.inner.max_encoded_size(numel), _MAX_RATIO * len(frame))
        try:
            params = zstandard.get_frame_parameters(frame)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name} payload is not a zstd frame: {e}") from None
        declared = params.content_size
        if declared == 0:
            # python-zstandard returns b"" for such a frame without reading what follows its
            # header: check that it is the empty frame, and nothing trails it.
            rest = bytes(frame[zstandard.frame_header_size(frame) :])
            if rest[:3] != _EMPTY_LAST_BLOCK or len(rest) != 3 + 4 * params.has_checksum:
                raise CodecError(f"{self.name} payload: a zstd frame of no content followed by {len(rest)} bytes that are not its one empty block")
            return b""
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
            raise CodecError(
                f"{self.name} frame declares {declared} bytes of content, but {self.inner.name} encodes "
                f"{numel} elements in at most {self.inner.max_encoded_size(numel)} and a {len(frame)}-byte frame holds at most "
                f"{_MAX_RATIO * len(frame)} (refusing to inflate it)"
            )
        try:
            # With a declared size zstd inflates into exactly that many bytes; without one
            # it gets a buffer of `limit` bytes and fails rather than grow it.
            # (max_output_size=0 would mean "unlimited", hence at least 1.)
            return zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(limit, 1), allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name} payload: corrupt zstd frame or content over {limit} bytes ({e})") from None
