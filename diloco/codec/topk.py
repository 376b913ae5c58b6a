"""Top-k sparsification with 2-bit values (SparseLoCo-style; error feedback is the caller's)."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import torch

from diloco.codec.base import CodecError
from diloco.codec.sparse_index import decode_positions, encode_positions, index_bytes, index_format
from diloco.codec.wire import (
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

_K = struct.Struct("<I")
_LEVELS_AT = HEADER_BYTES + _K.size  # 12
_VALUES_AT = _LEVELS_AT + 8  # 20: header, k, then the two float32 levels


def two_level_magnitudes(mags: np.ndarray) -> tuple[float, float]:
    """(lo, hi) minimizing sum over m of min((m - lo)**2, (m - hi)**2): exact 1-D 2-means.

    In one dimension the optimal clusters split the sorted values in two runs, so every
    split point is scored with prefix sums (float64, on values divided by their max so
    squares neither overflow nor underflow) and the levels are the two runs' means.
    """
    a = np.sort(mags.astype(np.float64))
    top = a[-1]
    if a[0] == top:
        return float(top), float(top)
    a = a / top
    k = a.size
    s1, s2 = np.cumsum(a), np.cumsum(a * a)
    low_n = np.arange(1, k, dtype=np.float64)
    low_sum, high_sum = s1[:-1], s1[-1] - s1[:-1]
    sse = (s2[:-1] - low_sum**2 / low_n) + ((s2[-1] - s2[:-1]) - high_sum**2 / (k - low_n))
    split = int(np.argmin(sse))
    return float(low_sum[split] / low_n[split] * top), float(high_sum[split] / (k - low_n[split]) * top)


class TopK2BitCodec:
    """Keeps the k = max(1, ceil(density * numel)) largest-magnitude values of a chunk, each
    as 2 bits: bit 0 the sign, bit 1 which of two float32 magnitudes (lo, hi) it takes.

    lo and hi are the exact 2-means of the kept magnitudes (least squared error for two
    levels) and each kept value takes the nearer one, so a kept value's error is at most
    max(lo - t, M - hi, (hi - lo) / 2) for kept magnitudes in [t, M]. Dropped values decode
    to 0 (the caller's error-feedback residual carries them to a later round).
    Layout: 8-byte header (param = index format, see sparse_index) + k:u32 + lo:f32 + hi:f32,
    then the 2-bit codes of the kept values in position order, four per byte from the low
    bits up (ceil(k / 4) bytes, zero padding codes), then the positions (sparse_index).
    Size: 20 + ceil(k / 4) + index_bytes(numel, k) bytes; at density 2% about 9.6 bits per
    kept value, 0.6% of fp32. Ties in magnitude at the k-th place are broken arbitrarily
    (but deterministically).
    """

    name = "topk2bit"

    def __init__(self, density: float = 0.02) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"topk2bit: density={density} must be in (0, 1]")
        self.density = density
        self._fraction = Fraction(repr(density))  # exact, so ceil(0.07 * 100) is 7, not 8

    def __repr__(self) -> str:
        return f"TopK2BitCodec(density={self.density})"

    def k_for(self, numel: int) -> int:
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self._fraction * numel)))

    def encoded_size(self, numel: int) -> int:
        k = self.k_for(numel)
        return _VALUES_AT + ceil_div(k, 4) + index_format(numel, k)[1]

    def max_encoded_size(self, numel: int) -> int:
        # Any k <= numel: at most one value byte per 4 elements, and the chosen index
        # format is never larger than the bitmap.
        return _VALUES_AT + ceil_div(numel, 4) + ceil_div(numel, 8)

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return largest_fitting(self.encoded_size, chunk_bytes)

    def encode(self, flat: torch.Tensor) -> bytes:
        x = as_float32(flat).numpy()
        n = x.size
        k = self.k_for(n)
        mags = np.abs(x)
        # argpartition puts NaN last, so a NaN or inf input is always among the kept values.
        positions = np.sort(np.argpartition(mags, n - k)[n - k :]) if k else np.zeros(0, dtype=np.int64)
        kept = x[positions]
        kept_mags = mags[positions]
        check_finite_input(self.name, not np.isfinite(kept_mags).all())
        lo, hi = two_level_magnitudes(kept_mags) if k else (0.0, 0.0)
        lo32, hi32 = np.float32(lo), np.float32(hi)
        codes = (kept < 0).astype(np.uint8)
        codes |= (np.abs(kept_mags - hi32) < np.abs(kept_mags - lo32)).astype(np.uint8) << 1
        fmt = index_format(n, k)[0]
        return b"".join(
            [
                pack_header(self.name, fmt, n),
                _K.pack(k),
                np.array([lo32, hi32], dtype="<f4").tobytes(),
                _pack_2bit(codes),
                encode_positions(positions.astype(np.int64), n, fmt),
            ]
        )

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        fmt = parse_header(self.name, payload, numel)
        if len(payload) < _VALUES_AT:
            raise CodecError(f"topk2bit payload has {len(payload)} bytes, shorter than its {_VALUES_AT}-byte header")
        (k,) = _K.unpack_from(payload, HEADER_BYTES)
        if k > numel:
            raise CodecError(f"topk2bit payload declares k={k} kept values, more than the chunk's {numel} elements")
        expected_fmt = index_format(numel, k)[0]
        if fmt != expected_fmt:
            raise CodecError(f"topk2bit payload declares index format {fmt}, expected {expected_fmt} for k={k} of {numel}")
        n_value_bytes = ceil_div(k, 4)
        expected = _VALUES_AT + n_value_bytes + index_bytes(numel, k, fmt)
        check_length(self.name, payload, expected, f"k={k} of {numel} elements")
        lo, hi = (float(v) for v in float32_array(payload, _LEVELS_AT, 2))
        if not (math.isfinite(hi) and 0 <= lo <= hi):
            raise CodecError(f"topk2bit payload has levels lo={lo}, hi={hi}: need finite 0 <= lo <= hi")
        codes = _unpack_2bit(np.frombuffer(payload, dtype=np.uint8, count=n_value_bytes, offset=_VALUES_AT), k)
        positions = decode_positions(payload, _VALUES_AT + n_value_bytes, numel, k, fmt, "topk2bit payload")
        out = torch.zeros(numel)
        table = np.array([lo, -lo, hi, -hi], dtype=np.float32)
        out[torch.from_numpy(positions)] = torch.from_numpy(np.take(table, codes))
        return out


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
