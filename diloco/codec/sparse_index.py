"""Compact coding of k sorted distinct positions in [0, n): Elias-Fano or a bitmap.

Both sizes depend only on (n, k), so a sparse codec's payload size is known before
encoding. ``index_format(n, k)`` picks the smaller one:

* bitmap (format ``BITMAP``): bit p set for every kept position; ceil(n / 8) bytes.
* Elias-Fano with L low bits (format L, 0 <= L <= 31): the low L bits of every position,
  packed back to back (ceil(k * L / 8) bytes), then an upper bitvector of
  k + ((n - 1) >> L) + 1 bits where position i (in sorted order) sets bit
  (p_i >> L) + i: the high parts in unary (ceil((k + ((n - 1) >> L) + 1) / 8) bytes).
  With L near log2(n / k) this costs about 2 + log2(n / k) bits per position: 7.6 bits
  at density 2%, against 8.6 for byte varints of the gaps and 50 for a bitmap.

Bits are little-endian within bytes; padding bits must be zero. Every size is a
nondecreasing function of n and k, so the chosen (smallest) one is too.
"""

from __future__ import annotations

import numpy as np

from diloco.codec.base import CodecError
from diloco.codec.header import ceil_div

BITMAP = 0xFFFF
MAX_LOW_BITS = 31


def _elias_fano_bytes(n: int, k: int, low_bits: int) -> int:
    return ceil_div(k * low_bits, 8) + ceil_div(k + ((n - 1) >> low_bits) + 1, 8)


def index_format(n: int, k: int) -> tuple[int, int]:
    """(format, bytes) of the smallest coding of k positions among n; a bitmap on ties."""
    best = (BITMAP, ceil_div(n, 8))
    if n == 0:
        return best
    for low_bits in range(MAX_LOW_BITS + 1):
        size = _elias_fano_bytes(n, k, low_bits)
        if size < best[1]:
            best = (low_bits, size)
    return best


def index_bytes(n: int, k: int, fmt: int) -> int:
    return ceil_div(n, 8) if fmt == BITMAP else _elias_fano_bytes(n, k, fmt)


def encode_positions(positions: np.ndarray, n: int, fmt: int) -> bytes:
    """``positions``: sorted distinct int64 in [0, n)."""
    k = positions.size
    if fmt == BITMAP:
        bits = np.zeros(n, dtype=np.uint8)
        bits[positions] = 1
        return np.packbits(bits, bitorder="little").tobytes()
    low_bits = fmt
    upper = np.zeros(k + ((n - 1) >> low_bits) + 1, dtype=np.uint8)
    upper[(positions >> low_bits) + np.arange(k)] = 1
    low = (positions[:, None] >> np.arange(low_bits)) & 1
    return np.packbits(low.astype(np.uint8).reshape(-1), bitorder="little").tobytes() + np.packbits(upper, bitorder="little").tobytes()


def decode_positions(data: bytes, offset: int, n: int, k: int, fmt: int, what: str) -> np.ndarray:
    """The k positions coded at ``data[offset:]`` (exactly ``index_bytes`` long, checked by
    the caller), as sorted int64; CodecError naming ``what`` if they are not k distinct
    sorted positions below n or padding bits are set."""
    size = index_bytes(n, k, fmt)
    raw = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset)
    if fmt == BITMAP:
        positions = np.flatnonzero(np.unpackbits(raw, bitorder="little")).astype(np.int64)
        if positions.size != k:
            raise CodecError(f"{what}: the bitmap marks {positions.size} positions, the header declares {k}")
        if k and positions[-1] >= n:
            raise CodecError(f"{what}: the bitmap marks position {positions[-1]}, beyond {n} elements")
        return positions
    low_bits = fmt
    low_size = ceil_div(k * low_bits, 8)
    low_raw = np.unpackbits(raw[:low_size], bitorder="little")
    if low_raw[k * low_bits :].any():
        raise CodecError(f"{what}: padding bits after the low bits are set")
    upper_len = k + ((n - 1) >> low_bits) + 1
    set_bits = np.flatnonzero(np.unpackbits(raw[low_size:], bitorder="little"))
    if set_bits.size != k:
        raise CodecError(f"{what}: the upper bitvector holds {set_bits.size} positions, the header declares {k}")
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if set_bits[-1] >= upper_len:
        raise CodecError(f"{what}: a padding bit of the upper bitvector is set")
    weights = np.left_shift(1, np.arange(low_bits, dtype=np.int64))
    low = low_raw[: k * low_bits].reshape(k, low_bits).astype(np.int64) @ weights
    positions = ((set_bits.astype(np.int64) - np.arange(k)) << low_bits) | low
    if positions[-1] >= n or (k > 1 and not (np.diff(positions) > 0).all()):
        raise CodecError(f"{what}: the positions are not distinct, sorted and below {n}")
    return positions
