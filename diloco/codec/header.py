"""The small header every compressing codec puts in front of its payload, and size helpers.

Header (8 bytes, little-endian): ``magic:u8 version:u8 param:u16 numel:u32``. ``magic``
names the codec (a payload handed to the wrong decoder fails at byte 0), ``version`` is
the layout version (all 1 today), ``param`` is the codec's one parameter (block size,
scale exponent or index format) and ``numel`` repeats the element count, so a payload
attached to a chunk that declares another count is caught before anything is allocated.
fp32 has no header: it is the raw reference format and stays byte-compatible.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import torch

from diloco.codec.base import CodecError

VERSION = 1
HEADER = struct.Struct("<BBHI")
HEADER_BYTES = HEADER.size  # 8
MAX_NUMEL = (1 << 32) - 1  # numel is a u32 in the header

# One magic byte per codec; values far apart so a stray byte rarely matches another codec's.
MAGIC = {"fp16": 0xF6, "bf16": 0xBF, "int8": 0x18, "int4": 0x14, "e3m0": 0xE3, "topk2bit": 0x72, "zstd": 0x5A}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pack_header(codec: str, param: int, numel: int) -> bytes:
    if numel > MAX_NUMEL:
        raise CodecError(f"{codec}: {numel} elements do not fit one chunk (at most {MAX_NUMEL})")
    return HEADER.pack(MAGIC[codec], VERSION, param, numel)


def parse_header(codec: str, payload: bytes, numel: int) -> int:
    """Checks magic, version and numel of ``payload``; returns the header's param."""
    if numel < 0:
        raise CodecError(f"{codec}: negative element count {numel}")
    if len(payload) < HEADER_BYTES:
        raise CodecError(f"{codec} payload has {len(payload)} bytes, shorter than its {HEADER_BYTES}-byte header")
    magic, version, param, declared = HEADER.unpack_from(payload)
    if magic != MAGIC[codec]:
        raise CodecError(f"{codec} payload starts with magic byte 0x{magic:02x}, expected 0x{MAGIC[codec]:02x}")
    if version != VERSION:
        raise CodecError(f"{codec} payload has layout version {version}; this decoder reads version {VERSION}")
    if declared != numel:
        raise CodecError(f"{codec} payload header declares {declared} elements, the chunk declares {numel}")
    return param


def check_length(codec: str, payload: bytes, expected: int, what: str) -> None:
    if len(payload) != expected:
        raise CodecError(f"{codec} payload has {len(payload)} bytes, expected {expected} for {what}")


def largest_fitting(size: Callable[[int], int], budget: int, multiple: int = 1) -> int:
    """The largest n <= MAX_NUMEL with size(n) <= budget, for a nondecreasing ``size``.

    Rounded down to a multiple of ``multiple`` when at least one multiple fits. Raises
    ValueError when not even one element fits, rather than returning a size that overflows.
    """
    if size(1) > budget:
        raise ValueError(f"chunk_bytes={budget} is too small: one element needs {size(1)} bytes")
    lo, hi = 1, MAX_NUMEL
    if size(hi) <= budget:
        lo = hi
    while lo < hi:  # invariant: size(lo) <= budget, and size(n) > budget for every n > hi
        mid = (lo + hi + 1) // 2
        if size(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo - lo % multiple if lo >= multiple else lo


def check_finite_input(codec: str, bad: bool) -> None:
    if bad:
        raise CodecError(f"{codec}: cannot encode non-finite values (inf or nan in the input)")


def as_float32(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as a contiguous 1-D float32 tensor (no copy when it already is one)."""
    if flat.dim() != 1:
        raise ValueError(f"codecs take a 1-D slice, got shape {list(flat.shape)}")
    return flat.detach().to(torch.float32).contiguous()


def float32_array(payload: bytes, offset: int, count: int) -> np.ndarray:
    """``count`` float32 values of ``payload`` starting at byte ``offset`` (a read-only view)."""
    return np.frombuffer(payload, dtype="<f4", count=count, offset=offset)
