"""Blockwise absmax quantizers: int8, int4 and e3m0 (4-bit sign + exponent).

Every block of B consecutive values (the last one may be shorter) gets one float32 scale
derived from its absmax; each value becomes a small code relative to that absmax.
Layout: 8-byte header (param = B) + ceil(numel / B) float32 scales + the codes (one byte
each for int8; two 4-bit codes per byte for int4 and e3m0, element 2i in the low nibble
of byte i, element 2i+1 in the high nibble, a zero high nibble padding an odd count).
A block of zeros has scale 0 and decodes to exact zeros; every code decodes to a finite
value, and a decoder rejects negative or non-finite scales. The scale is absmax / max_code
rounded down by an ulp where needed so that max_code * scale <= absmax: decoding never
overshoots the block's absmax, nor overflows to inf near float32's max.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

from diloco.codec.base import CodecError, check_out
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

MAX_BLOCK = 0xFFFF  # B is a u16 in the header


def _block_absmax(x: torch.Tensor, block: int) -> np.ndarray:
    """max |x| over each block of ``block`` values (the last block may be shorter), as a
    float32 numpy array: the per-block arithmetic after this is on a few thousand values,
    where numpy's per-call cost (about 1 us) beats torch's (about 5 us)."""
    n = x.numel()
    full = n // block * block
    # max(max x, -min x) reads x twice and writes nothing, unlike x.abs().amax().
    rows = x[:full].view(-1, block) if full else x.view(1, n)
    parts = [np.maximum(rows.amax(dim=1).numpy(), -rows.amin(dim=1).numpy())] if n else []
    if full and full < n:
        tail = x[full:]
        parts.append(np.array([max(float(tail.amax()), -float(tail.amin()))], dtype=np.float32))
    absmax = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, np.float32)
    return np.abs(absmax, out=absmax)  # max(0, -0) may be -0: a zero block's scale is +0


def _apply_per_block(op: Callable[..., torch.Tensor], x: torch.Tensor, per_block: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """out = op(x, per_block value of each element's block), without expanding per_block."""
    n = x.numel()
    full = n // block * block
    if full:
        op(x[:full].view(-1, block), per_block[: full // block, None], out=out[:full].view(-1, block))
    if full < n:
        op(x[full:], per_block[-1], out=out[full:])
    return out


class _BlockScaled:
    """Shared layout and checks; subclasses define the scale, the codes and their values."""

    name: str
    code_bits: int  # 8 or 4
    max_code: float  # the largest code magnitude: scale = absmax / max_code
    default_block: int

    def __init__(self, block: int | None = None) -> None:
        block = self.default_block if block is None else block
        if not 1 <= block <= MAX_BLOCK:
            raise ValueError(f"{self.name}: block={block} must be in 1..{MAX_BLOCK}")
        self.block = block

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"

    def _code_bytes(self, numel: int) -> int:
        return numel if self.code_bits == 8 else ceil_div(numel, 2)

    def encoded_size(self, numel: int) -> int:
        return HEADER_BYTES + 4 * ceil_div(numel, self.block) + self._code_bytes(numel)

    def max_encoded_size(self, numel: int) -> int:
        return HEADER_BYTES + 4 * numel + self._code_bytes(numel)  # block size 1

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return largest_fitting(self.encoded_size, chunk_bytes, multiple=self.block)

    def encode(self, flat: torch.Tensor) -> bytes:
        x = as_float32(flat)
        absmax = _block_absmax(x, self.block)
        check_finite_input(self.name, not bool(np.isfinite(absmax).all()))
        scales = self._scales(absmax)
        codes = self._fast_codes(x, scales)
        if codes is None:
            # Divide by absmax itself (1 for a zero block), not multiply by a reciprocal: the
            # reciprocal of a subnormal absmax overflows float32. |x / absmax| <= 1 exactly.
            divisor = torch.from_numpy(np.where(absmax > 0, absmax, np.float32(1)))
            codes = self._codes(_apply_per_block(torch.div, x, divisor, self.block, torch.empty_like(x))).numpy()
        header = pack_header(self.name, self.block, x.numel())
        return b"".join((header, scales.tobytes(), codes))

    def _fast_codes(self, x: torch.Tensor, scales: np.ndarray) -> bytes | None:
        """The codes in fewer passes over x, or None to take the general path."""
        return None

    def _scales(self, absmax: np.ndarray) -> np.ndarray:
        """absmax / max_code, rounded down where the largest code times it would exceed
        absmax (near float32's max that product would round to inf)."""
        max_code = np.float32(self.max_code)
        scales = absmax / max_code
        with np.errstate(over="ignore"):  # a product that overflows is inf: over, as it should be
            over = scales * max_code > absmax
            while over.any():
                scales = np.where(over, np.nextafter(scales, np.float32(0)), scales)
                over = scales * max_code > absmax
        return scales

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        block, scales = self._layout(payload, numel)
        return self._dequantize(payload, block, scales, numel)

    def _layout(self, payload: bytes, numel: int) -> tuple[int, np.ndarray]:
        """The header's block size and the scales, checked: CodecError where they do not fit."""
        block = parse_header(self.name, payload, numel)
        if block == 0:
            raise CodecError(f"{self.name} payload header declares block size 0")
        n_blocks = ceil_div(numel, block)
        expected = HEADER_BYTES + 4 * n_blocks + self._code_bytes(numel)
        check_length(self.name, payload, expected, f"{numel} elements in blocks of {block}")
        scales = float32_array(payload, HEADER_BYTES, n_blocks)
        bad = ~(np.isfinite(scales) & (scales >= 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CodecError(f"{self.name} payload has scale {scales[i]} in block {i}: scales must be finite and >= 0")
        return block, scales

    def _dequantize(self, payload: bytes, block: int, scales: np.ndarray, numel: int) -> torch.Tensor:
        """code value x scale of every element (the payload's layout is checked already)."""
        values = self._values(payload, HEADER_BYTES + 4 * len(scales), numel)
        return _apply_per_block(torch.mul, values, torch.from_numpy(scales.copy()), block, values)

    def check_payload(self, payload: bytes, numel: int) -> None:
        """The fused intake's check (the Codec docstring), from the header and the scales
        alone: a code's value |v| * scale <= largest * scale in float32 (``largest``: the
        largest |value| any code of the payload's width decodes to, 128 for int8's -128),
        so every value is finite exactly when largest * scale is for every block (a sender's
        scale near float32's max would overflow)."""
        _, scales = self._layout(payload, numel)
        with np.errstate(over="ignore"):
            over = ~np.isfinite(scales * np.float32(self._largest))
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise CodecError(f"non-finite values: block {i}'s scale {scales[i]} times {self._largest:g} overflows float32")
        self._check_codes(payload, numel, len(scales))

    def _check_codes(self, payload: bytes, numel: int, n_blocks: int) -> None:
        """What ``_values`` refuses in the codes themselves (nothing, for whole bytes)."""

    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        """Codes for x / absmax in [-1, 1] (may overwrite ``ratio``): int8 or uint8 per element."""
        raise NotImplementedError

    def _values(self, payload: bytes, offset: int, numel: int) -> torch.Tensor:
        """The codes at ``offset`` as float32 multiples of the stored scale (a new tensor)."""
        raise NotImplementedError


try:
    from diloco.codec import _int8_native as _native
except ImportError:  # not compiled (setup.py makes it optional): the torch path, same bytes
    _native = None

_ROUNDING_MAGIC = 1.5 * 2**23
_LOW_BYTE = 0 if sys.byteorder == "little" else 3  # of a float32's 4 bytes


class Int8Codec(_BlockScaled):
    """int8 with one float32 scale = absmax / 127 per block of B values (default 1024).

    Codes round(x / scale) in [-127, 127]; |x - decoded| <= absmax_block / 254 (for all the
    blockwise codecs, plus float32 rounding: <= absmax_block * 2**-21, and <= max_code * 2**-149
    where the scale is a float32 subnormal, below absmax ~1.5e-36).
    Size: 8 + 4 * ceil(numel / B) + numel bytes.
    """

    name = "int8"
    code_bits = 8
    max_code = 127.0
    _largest = 128.0  # |-128|: never written, but a payload may hold it
    default_block = 1024
    # The C loops of _int8_native.c where they were compiled: the same bytes, fewer passes.
    use_native = _native is not None

    def encode(self, flat: torch.Tensor) -> bytes:
        if self.use_native:
            x = as_float32(flat)
            try:
                payload = _native.encode(x.numpy(), self.block, pack_header(self.name, self.block, x.numel()))
            except ValueError:
                check_finite_input(self.name, True)
            if payload is not None:
                return payload
        return super().encode(flat)

    def _dequantize(self, payload: bytes, block: int, scales: np.ndarray, numel: int) -> torch.Tensor:
        if not self.use_native:
            return super()._dequantize(payload, block, scales, numel)
        out = torch.empty(numel, dtype=torch.float32)
        _native.decode(payload, HEADER_BYTES, block, out.numpy())
        return out

    def decode_into(self, payload: bytes, numel: int, out: torch.Tensor) -> None:
        """``decode`` written into ``out`` (a contiguous float32 CPU tensor of ``numel``
        elements): no temporary tensor where the C loops are compiled."""
        check_out(out, numel)
        block, scales = self._layout(payload, numel)
        if self.use_native:
            _native.decode(payload, HEADER_BYTES, block, out.numpy())
        else:
            out.copy_(self._dequantize(payload, block, scales, numel))

    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio.mul_(127).round_().to(torch.int8)

    def accumulate(self, payload: bytes, numel: int, out: torch.Tensor, alpha: float) -> None:
        """``out += alpha * decode(payload)`` in float64 without the float32 copy (checked
        already by ``check_payload``): code * scale in float32 as ``decode`` gives it, then
        widened, times alpha and added in float64."""
        if not self.use_native:
            out.add_(self.decode(payload, numel), alpha=alpha)
            return
        block = parse_header(self.name, payload, numel)
        _native.accumulate(payload, HEADER_BYTES, block, numel, out.numpy(), float(alpha))

    def _fast_codes(self, x: torch.Tensor, scales: np.ndarray) -> bytes | None:
        # round(x * (1 / scale)): one multiply per value instead of a divide and a multiply.
        # x * (1 / scale) is within an ulp of x / scale <= 127 * (1 + 2**-23), so the codes
        # stay in [-127, 127] and the error bound holds. Blocks whose 1 / scale overflows
        # (absmax below ~4e-37) take the general path.
        with np.errstate(divide="ignore", over="ignore"):
            inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > 0)
        if not np.isfinite(inv).all():
            return None
        y = _apply_per_block(torch.mul, x, torch.from_numpy(inv), self.block, torch.empty_like(x))
        # Rounding and narrowing in one pass: adding 1.5 * 2**23 to |y| <= 128 leaves a float
        # whose unit in the last place is 1, so the addition itself rounds y to the nearest
        # integer k (ties to even, exactly as round()), and the float's bit pattern is that
        # of 1.5 * 2**23 (low byte 0) plus k: its low byte is k as a two's complement int8.
        y.add_(_ROUNDING_MAGIC)
        return y.numpy().view(np.uint8)[_LOW_BYTE::4].tobytes()

    def _values(self, payload: bytes, offset: int, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(payload, dtype=np.int8, count=numel, offset=offset).astype(np.float32))


def absmax_bounded_block(codec: object) -> int | None:
    """The block size B when ``codec`` (or the codec a +zstd one wraps) is blockwise-scaled
    (int8, int4, e3m0): no value it encodes decodes past its block's absmax in magnitude
    (every code it writes is at most max_code, and max_code * scale <= absmax), so the
    decoded values of x are bounded by x's absmax per block of B from a payload's start.
    None for any other codec."""
    inner = getattr(codec, "inner", codec)
    return inner.block if isinstance(inner, _BlockScaled) else None


class _NibbleCodec(_BlockScaled):
    """Two 4-bit codes per byte; ``_nibble_values[c]`` is what code c decodes to (times scale)."""

    code_bits = 4
    _nibble_values: np.ndarray  # 16 float32

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        # byte b -> (value of its low nibble, value of its high nibble): one table lookup
        # decodes two elements.
        b = np.arange(256)
        cls._byte_values = np.stack([cls._nibble_values[b & 15], cls._nibble_values[b >> 4]], axis=1).astype(np.float32)
        cls._largest = float(np.abs(cls._nibble_values).max())
        cls._table = np.ascontiguousarray(cls._nibble_values, dtype=np.float32).tobytes()

    def _check_codes(self, payload: bytes, numel: int, n_blocks: int) -> None:
        if numel % 2 and payload[HEADER_BYTES + 4 * n_blocks + numel // 2] >> 4:
            raise CodecError(f"{self.name} payload: the padding nibble after element {numel - 1} is not zero")

    def accumulate(self, payload: bytes, numel: int, out: torch.Tensor, alpha: float) -> None:
        """``out += alpha * decode(payload)`` in float64 (checked already by ``check_payload``):
        level * scale in float32 as ``decode`` gives it, then widened, times alpha and added."""
        if _native is None:
            out.add_(self.decode(payload, numel), alpha=alpha)
            return
        block = parse_header(self.name, payload, numel)
        _native.accumulate_nibbles(payload, HEADER_BYTES, block, numel, self._table, out.numpy(), float(alpha))

    def _codes(self, ratio: torch.Tensor) -> torch.Tensor:
        nibbles = self._nibbles(ratio)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _nibbles(self, ratio: torch.Tensor) -> torch.Tensor:
        """uint8 codes in 0..15 for x / absmax in [-1, 1]."""
        raise NotImplementedError

    def _values(self, payload: bytes, offset: int, numel: int) -> torch.Tensor:
        packed = np.frombuffer(payload, dtype=np.uint8, count=ceil_div(numel, 2), offset=offset)
        if numel % 2 and packed[-1] >> 4:
            raise CodecError(f"{self.name} payload: the padding nibble after element {numel - 1} is not zero")
        return torch.from_numpy(np.take(self._byte_values, packed, axis=0).reshape(-1)[:numel])


class Int4Codec(_NibbleCodec):
    """Signed 4-bit ints in [-7, 7] with one float32 scale = absmax / 7 per block of B values.

    Codes are two's complement nibbles (-8 is never written and decodes to -8 * scale).
    |x - decoded| <= absmax_block / 14. Default B = 128, not 1024: with only 15 levels the
    error scales with the block's absmax, and on Gaussian data B=128 cuts the mean squared
    error by a third against B=1024 (3x on heavy-tailed Student-t(3) data, where outliers
    inflate a large block's absmax) for 0.25 extra bits per value (4.25 vs 4.03 bits).
    Size: 8 + 4 * ceil(numel / B) + ceil(numel / 2) bytes.
    """

    name = "int4"
    max_code = 7.0
    default_block = 128
    _nibble_values = np.array([*range(8), *range(-8, 0)], dtype=np.float32)

    def _nibbles(self, ratio: torch.Tensor) -> torch.Tensor:
        return ratio.mul_(7).round_().to(torch.int8).view(torch.uint8).bitwise_and_(15)


# e3m0: x / absmax = r, |r| in [0, 1]. Exponent code e in 0..7 stands for magnitude
# 2**(e - 7) (e >= 1: 1/64 .. 1) or exact zero (e = 0); bit 3 is the sign.
# Bits 22..29 of a float32 in [0, 1] hold 2 * biased exponent + the top mantissa bit; the
# value with exponent 120 (2**-7, the zero/1/64 midpoint) and mantissa bit 0 is this one.
_E3M0_LOW_HALF_OF_2_POW_MINUS_7 = 240


class E3M0Codec(_NibbleCodec):
    """4-bit sign + 3-bit exponent, no mantissa (Streaming DiLoCo's E3M0), one float32 scale
    = absmax per block of B values (default 1024: unlike int4, the levels span a factor 64,
    so a smaller block buys little; on Gaussian data B=128 lowers the MSE by only 3%, on
    Student-t(3) by 21%, for 6% more bytes).

    Code = sign << 3 | e; e = 0 is exact zero, e = 1..7 is absmax * 2**(e - 7), so the
    magnitudes are {0, A/64, A/32, A/16, A/8, A/4, A/2, A} (A = block absmax). Rounding is
    to the nearest level in linear space (not log space): for fixed levels that minimizes
    both the largest and the mean squared error; a value goes up one level when its
    mantissa is >= 1.5 (|r| >= 0.75 * 2**k), and to the smallest level when |r| >= 1/128.
    |x - decoded| <= max(|x| / 3, A / 128). Codes 0 and 8 (a negative value rounding to
    zero) both decode to +0.
    Size: 8 + 4 * ceil(numel / B) + ceil(numel / 2) bytes.
    """

    name = "e3m0"
    max_code = 1.0
    default_block = 1024
    _nibble_values = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)] + [0.0] + [-(2.0 ** (e - 7)) for e in range(1, 8)], dtype=np.float32)

    def _nibbles(self, ratio: torch.Tensor) -> torch.Tensor:
        negative = (ratio < 0).view(torch.uint8)
        # One byte per value from here on: a = 2 * biased exponent + top mantissa bit of |r|
        # (the sign bit falls off the uint8). (a + 1) >> 1 is the exponent rounded up when
        # the mantissa is >= 1.5, i.e. where the next power of two is the nearest level.
        a = (ratio.view(torch.int32) >> 22).to(torch.uint8)
        e = a.add(1).bitwise_right_shift_(1).clamp_(120, 127).sub_(120)
        # ... except below 2**-6, where the midpoint to 0 is 2**-7, not 0.75 * 2**-6 (e is 0
        # there, so or-ing sets it to 1).
        e.bitwise_or_((a == _E3M0_LOW_HALF_OF_2_POW_MINUS_7).view(torch.uint8))
        # A negative value rounding to zero keeps its sign bit: code 8 decodes to +0 too.
        return e.bitwise_or_(negative.bitwise_left_shift_(3))
