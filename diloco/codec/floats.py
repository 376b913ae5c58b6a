"""16-bit float codecs: fp16 (with a power-of-two chunk scale) and bf16 (a plain cast)."""

from __future__ import annotations

import math

import numpy as np
import torch

from diloco.codec.base import CodecError
from diloco.codec.header import (
    HEADER_BYTES,
    as_float32,
    check_finite_input,
    check_length,
    largest_fitting,
    pack_header,
    parse_header,
)

# The chunk exponent e of fp16 satisfies absmax * 2**-e in [2**14, 2**15); over the finite
# float32 range (absmax from 2**-149 to just under 2**128) that puts e in this range.
_FP16_EXP_MIN, _FP16_EXP_MAX = -163, 113
_FP16_TOP_BELOW_2_15 = 32752.0  # the largest float16 under 2**15
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _mul_pow2_(t: torch.Tensor, e: int) -> torch.Tensor:
    """t *= 2**e in place, in steps whose factors float32 can represent (2**±100)."""
    while e > 100:
        t.mul_(2.0**100)
        e -= 100
    while e < -100:
        t.mul_(2.0**-100)
        e += 100
    return t.mul_(2.0**e)


class _TwoBytesPerValue:
    """Sizes shared by the 16-bit float codecs: an 8-byte header, then 2 bytes per value."""

    byte_planes = (HEADER_BYTES, 2)

    def encoded_size(self, numel: int) -> int:
        return HEADER_BYTES + 2 * numel

    def max_encoded_size(self, numel: int) -> int:
        return self.encoded_size(numel)

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return largest_fitting(self.encoded_size, chunk_bytes)

    def slice_payload(self, payload: bytes, numel: int, start: int, stop: int) -> bytes:
        """Elements [start, stop): the same header parameter (fp16's exponent) and values."""
        param = parse_header(self.name, payload, numel)
        body = payload[HEADER_BYTES + 2 * start : HEADER_BYTES + 2 * stop]
        return pack_header(self.name, param, stop - start) + body


class Fp16Codec(_TwoBytesPerValue):
    """IEEE half precision after a per-chunk power-of-two scale.

    Layout: 8-byte header (param = the chunk exponent e as int16) + numel float16 values
    y_i = fp16(x_i * 2**-e), so the decoded value is y_i * 2**e. e is chosen so the chunk's
    absmax lands in [2**14, 2**15): a plain cast would turn |x| > 65504 into inf and lose
    all precision below 6e-5 (pseudo-gradients are often that small); scaling by a power of
    two is exact, so every value within 2**-28 of the chunk absmax keeps fp16's relative
    precision (|error| <= 2**-11 |x|), smaller ones an absolute error <= absmax * 2**-39
    (half of fp16's smallest subnormal, 2**-25, times 2**e <= absmax * 2**-14).
    Size: 8 + 2 * numel bytes.
    """

    name = "fp16"

    def encode(self, flat: torch.Tensor) -> bytes:
        x = as_float32(flat)
        lo = hi = 0.0
        if x.numel():
            lo, hi = (float(v) for v in torch.aminmax(x))
        check_finite_input(self.name, not (math.isfinite(lo) and math.isfinite(hi)))
        absmax = max(-lo, hi)
        e = math.frexp(absmax)[1] - 15 if absmax > 0 else 0
        y = _mul_pow2_(x.clone(), -e)
        if e == _FP16_EXP_MAX:  # absmax near float32's max: a round-up to 2**15 would decode to inf
            y.clamp_(-_FP16_TOP_BELOW_2_15, _FP16_TOP_BELOW_2_15)
        header = pack_header(self.name, e & 0xFFFF, x.numel())
        return header + y.to(torch.float16).numpy().tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        param = parse_header(self.name, payload, numel)
        check_length(self.name, payload, self.encoded_size(numel), f"{numel} elements")
        e = param - 0x10000 if param >= 0x8000 else param
        if not _FP16_EXP_MIN <= e <= _FP16_EXP_MAX:
            raise CodecError(f"fp16 payload declares scale exponent {e}, outside [{_FP16_EXP_MIN}, {_FP16_EXP_MAX}]")
        halves = np.frombuffer(payload, dtype="<f2", count=numel, offset=HEADER_BYTES)
        return _mul_pow2_(torch.from_numpy(halves.astype(np.float32)), e)


class Bf16Codec(_TwoBytesPerValue):
    """bfloat16 by round-to-nearest-even cast (same exponent range as float32).

    Layout: 8-byte header (param 0) + numel little-endian uint16 (the bf16 bit patterns).
    |error| <= 2**-8 |x| (below 2**-126, where both formats are subnormal: <= 2**-134). Values beyond bf16's largest finite value (3.39e38) saturate to it
    instead of becoming inf. Size: 8 + 2 * numel bytes.
    """

    name = "bf16"

    def encode(self, flat: torch.Tensor) -> bytes:
        x = as_float32(flat)
        if x.numel():
            lo, hi = (float(v) for v in torch.aminmax(x))
            check_finite_input(self.name, not (math.isfinite(lo) and math.isfinite(hi)))
            if max(-lo, hi) > _BF16_MAX:  # would round to inf
                x = x.clamp(-_BF16_MAX, _BF16_MAX)
        y = x.to(torch.bfloat16)
        return pack_header(self.name, 0, x.numel()) + y.view(torch.int16).numpy().tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        param = parse_header(self.name, payload, numel)
        if param != 0:
            raise CodecError(f"bf16 payload header has parameter {param}, expected 0")
        check_length(self.name, payload, self.encoded_size(numel), f"{numel} elements")
        bits = np.frombuffer(payload, dtype="<u2", count=numel, offset=HEADER_BYTES).astype(np.uint32)
        bits <<= 16
        return torch.from_numpy(bits.view(np.float32))
