"""Chunk-wise top-k sparsification with 2-bit values (SparseLoCo-style; error feedback is the caller's)."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import torch

from diloco.codec.base import CodecError, _native
from diloco.codec.header import (
    HEADER_BYTES,
    as_float32,
    ceil_div,
    check_finite_input,
    check_length,
    float32_array,
    largest_fitting,
    pack_header,
    parse_header,
)
from diloco.codec.sparse_index import decode_positions, encode_positions, index_bytes, index_format

_KB = struct.Struct("<II")  # k, block
_LEVELS_AT = HEADER_BYTES + _KB.size  # 16
DEFAULT_BLOCK = 4096  # SparseLoCo's chunk: 64 x 64 values
MIN_BLOCK = 32  # so the levels (8 bytes per block) never outgrow the values they scale


def two_level_rows(mags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``mags`` (rows x k, k >= 1), the exact 2-means (lo, hi) of its values.

    In one dimension the optimal clusters split the sorted values in two runs, so every
    split point is scored with prefix sums (float64, on values divided by the row's max so
    squares neither overflow nor underflow) and the levels are the two runs' means. A row of
    equal values gets lo = hi = that value.
    """
    a = np.sort(mags.astype(np.float64), axis=1)
    largest = a[:, -1].copy()
    flat = a[:, 0] == largest
    k = a.shape[1]
    if k == 1 or flat.all():
        return largest, largest.copy()
    top = largest[:, None].copy()
    top[flat] = 1.0  # rows of equal values (zeros included) are answered below
    a = a / top
    s1, s2 = np.cumsum(a, axis=1), np.cumsum(a * a, axis=1)
    low_n = np.arange(1, k, dtype=np.float64)
    low_sum, high_sum = s1[:, :-1], s1[:, -1:] - s1[:, :-1]
    sse = (s2[:, :-1] - low_sum**2 / low_n) + ((s2[:, -1:] - s2[:, :-1]) - high_sum**2 / (k - low_n))
    split = np.argmin(sse, axis=1)
    rows = np.arange(a.shape[0])
    lo = low_sum[rows, split] / low_n[split] * top[:, 0]
    hi = high_sum[rows, split] / (k - low_n[split]) * top[:, 0]
    lo[flat] = hi[flat] = largest[flat]
    return lo, hi


class TopK2BitCodec:
    """Per block of ``block`` values (SparseLoCo's chunk-wise top-k), keeps the
    k_b = max(1, ceil(density * block)) largest-magnitude values, each as 2 bits: bit 0 the
    sign, bit 1 which of the block's two float32 magnitudes (lo, hi) it takes. The last block
    of a chunk may be shorter (its k_b from its own length).

    Selecting per block spreads the kept values over the whole tensor (every row of a matrix
    gets its share each round) instead of letting a few large rows take them all; the
    residual carries the rest either way. lo and hi are the exact 2-means of the block's kept
    magnitudes and each kept value takes the nearer one, so a kept value's error is at most
    max(lo - t, M - hi, (hi - lo) / 2) for the block's kept magnitudes in [t, M]. Dropped
    values decode to 0 (the caller's error-feedback residual carries them to a later round).
    Layout: 8-byte header (param = index format, see sparse_index) + k:u32 + block:u32, the
    levels (lo:f32, hi:f32) of each of the ceil(numel / block) blocks, then the 2-bit codes
    of the kept values in position order, four per byte from the low bits up (ceil(k / 4)
    bytes, zero padding codes), then the positions (sparse_index). The block size travels in
    the payload, so any instance decodes it.
    Size: 16 + 8 * ceil(numel / block) + ceil(k / 4) + index_bytes(numel, k) bytes; at
    density 2% and block 4096 about 10.4 bits per kept value, 0.65% of fp32. Ties in
    magnitude at a block's k-th place are broken arbitrarily (but deterministically).
    """

    name = "topk2bit"

    def __init__(self, density: float = 0.02, block: int = DEFAULT_BLOCK) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"topk2bit: density={density} must be in (0, 1]")
        if not (isinstance(block, int) and MIN_BLOCK <= block <= 0xFFFFFFFF):
            raise ValueError(f"topk2bit: block={block} must be an integer of at least {MIN_BLOCK}")
        self.density = density
        self.block = block
        self._fraction = Fraction(repr(density))  # exact, so ceil(0.07 * 100) is 7, not 8

    def __repr__(self) -> str:
        return f"TopK2BitCodec(density={self.density}, block={self.block})"

    def _k_of(self, length: int) -> int:
        return min(length, max(1, math.ceil(self._fraction * length))) if length else 0

    def k_for(self, numel: int) -> int:
        """Values kept of a chunk of ``numel``: the sum over its blocks."""
        full, tail = divmod(numel, self.block)
        return full * self._k_of(self.block) + self._k_of(tail)

    def encoded_size(self, numel: int) -> int:
        k = self.k_for(numel)
        return _LEVELS_AT + 8 * ceil_div(numel, self.block) + ceil_div(k, 4) + index_format(numel, k)[1]

    def max_encoded_size(self, numel: int) -> int:
        # Any k <= numel and any block >= MIN_BLOCK: at most one value byte per 4 elements,
        # 8 level bytes per MIN_BLOCK elements, and the chosen index format is never larger
        # than the bitmap.
        return _LEVELS_AT + 8 * ceil_div(numel, MIN_BLOCK) + ceil_div(numel, 4) + ceil_div(numel, 8)

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return largest_fitting(self.encoded_size, chunk_bytes, multiple=self.block)

    def encode(self, flat: torch.Tensor) -> bytes:
        x = as_float32(flat).numpy()
        n, b = x.size, self.block
        full = n // b
        mags = np.abs(x)
        picks, levels = [], []
        for start, rows, length in ((0, full, b), (full * b, 1 if n % b else 0, n % b)):
            if rows == 0:
                continue
            k = self._k_of(length)
            m = mags[start : start + rows * length].reshape(rows, length)
            # argpartition puts NaN last, so a NaN or inf input is always among the kept values.
            idx = np.sort(np.argpartition(m, length - k, axis=1)[:, length - k :], axis=1)
            kept_mags = np.take_along_axis(m, idx, axis=1)
            check_finite_input(self.name, not np.isfinite(kept_mags).all())
            lo, hi = two_level_rows(kept_mags)
            picks.append((idx + start + length * np.arange(rows)[:, None]).reshape(-1))
            levels.append(np.stack([lo, hi], axis=1).astype(np.float32))
        positions = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
        table = np.concatenate(levels) if levels else np.zeros((0, 2), dtype=np.float32)
        kept = x[positions]
        block_of = positions // b
        lo32, hi32 = table[block_of, 0], table[block_of, 1]
        kept_mags = np.abs(kept)
        codes = (kept < 0).astype(np.uint8)
        codes |= (np.abs(kept_mags - hi32) < np.abs(kept_mags - lo32)).astype(np.uint8) << 1
        k = positions.size
        fmt = index_format(n, k)[0]
        return b"".join(
            [
                pack_header(self.name, fmt, n),
                _KB.pack(k, b),
                table.astype("<f4").tobytes(),
                _pack_2bit(codes),
                encode_positions(positions.astype(np.int64), n, fmt),
            ]
        )

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        positions, values = self.decode_sparse(payload, numel)
        out = torch.zeros(numel)
        out[torch.from_numpy(positions)] = torch.from_numpy(values)
        return out

    def decode_sparse(self, payload: bytes, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept values as (positions: int64, ascending; values: float32), every check of
        ``decode`` made: the fused intake adds them where they go without a dense copy
        (a 1 MiB chunk holds some 40 million elements at density 0.02)."""
        fmt = parse_header(self.name, payload, numel)
        if len(payload) < _LEVELS_AT:
            raise CodecError(f"topk2bit payload has {len(payload)} bytes, shorter than its {_LEVELS_AT}-byte header")
        k, block = _KB.unpack_from(payload, HEADER_BYTES)
        if k > numel:
            raise CodecError(f"topk2bit payload declares k={k} kept values, more than the chunk's {numel} elements")
        if block < MIN_BLOCK:
            raise CodecError(f"topk2bit payload declares block={block}; blocks have at least {MIN_BLOCK} values")
        expected_fmt = index_format(numel, k)[0]
        if fmt != expected_fmt:
            raise CodecError(f"topk2bit payload declares index format {fmt}, expected {expected_fmt} for k={k} of {numel}")
        blocks, n_value_bytes = ceil_div(numel, block), ceil_div(k, 4)
        values_at = _LEVELS_AT + 8 * blocks
        expected = values_at + n_value_bytes + index_bytes(numel, k, fmt)
        check_length(self.name, payload, expected, f"k={k} of {numel} elements in blocks of {block}")
        levels = float32_array(payload, _LEVELS_AT, 2 * blocks).reshape(blocks, 2)
        lo, hi = levels[:, 0], levels[:, 1]
        bad = ~(np.isfinite(hi) & (lo >= 0) & (lo <= hi))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CodecError(f"topk2bit payload has levels lo={float(lo[i])}, hi={float(hi[i])} in block {i}: need finite 0 <= lo <= hi")
        codes = _unpack_2bit(np.frombuffer(payload, dtype=np.uint8, count=n_value_bytes, offset=values_at), k)
        positions = decode_positions(payload, values_at + n_value_bytes, numel, k, fmt, "topk2bit payload")
        table = np.stack([lo, -lo, hi, -hi], axis=1)
        return positions, table[positions // block, codes]

    @staticmethod
    def add_sparse(positions: np.ndarray, values: np.ndarray, out: torch.Tensor, alpha: float) -> None:
        """``out[positions] += alpha * values`` in float64 (``decode_sparse``'s pair; ``out`` a
        contiguous float64 tensor of the chunk's elements): what adding ``decode``'s dense
        values gives, since the sum of products from +0 is never -0, so adding 0 changes no bit."""
        if _native is not None:
            _native.accumulate_sparse(positions, values, out.numpy(), float(alpha))
        elif len(positions):
            out.index_add_(0, torch.from_numpy(positions), torch.from_numpy(values).double(), alpha=alpha)


def _pack_2bit(codes: np.ndarray) -> bytes:
    padded = np.zeros(ceil_div(codes.size, 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).tobytes()


def _unpack_2bit(packed: np.ndarray, k: int) -> np.ndarray:
    codes = ((packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(-1)
    if codes[k:].any():
        raise CodecError(f"topk2bit payload: padding codes after the {k} kept values are not zero")
    return codes[:k]
