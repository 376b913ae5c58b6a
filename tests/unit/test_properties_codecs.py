"""Property tests of every codec's decoder, of the codec header and of the sparse position
index: any payload (random, well-formed with random contents, or a valid one cut, extended
or bit-flipped) and any element count decode to ``numel`` float32 values or raise CodecError
with a short message, never another exception and never a large allocation made on the word
of a size field; and encode -> decode keeps shape and finiteness (and every bit, for fp32)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from helpers import peak_bytes
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from diloco.codec import CodecError, get_codec, known_codecs, make_codec
from diloco.codec.header import HEADER, HEADER_BYTES, MAGIC, MAX_NUMEL, VERSION, ceil_div, pack_header, parse_header
from diloco.codec.sparse_index import BITMAP, decode_positions, encode_positions, index_bytes, index_format

PROPERTY = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MESSAGE = 1500
ALL = known_codecs()
ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
UNSIZED_FRAME = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(9))  # no content size

NUMEL = st.one_of(
    st.integers(0, 300),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-1, MAX_NUMEL, MAX_NUMEL + 1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]),
)
FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
ANY_FLOAT32 = st.floats(width=32)  # nan and inf too: what a hostile payload may carry


def decode(codec: Any, payload: bytes, numel: int) -> torch.Tensor | CodecError:
    """The decoded tensor, checked to be ``numel`` float32 values, or the CodecError (any
    other exception fails the test)."""
    try:
        y = codec.decode(payload, numel)
    except CodecError as e:
        assert len(str(e)) <= MAX_MESSAGE
        event(f"{codec.name}: refused")
        return e
    event(f"{codec.name}: decoded")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (numel,)
    return y


# ---- any bytes, any numel ------------------------------------------------------------------


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=400)
@given(name=st.sampled_from(ALL), payload=st.binary(max_size=200), numel=NUMEL, past_magic=st.booleans())
@example(name="int8+zstd", payload=b"\x5a\x01\x01\x00" + UNSIZED_FRAME, numel=2**40, past_magic=False).via(
    "bug: MemoryError: zstd was asked for an output buffer of 5 * numel bytes"
)
@example(name="fp32+zstd", payload=b"\x5a\x01\x04\x00" + zstandard.ZstdCompressor().compress(b"1234"), numel=2**62, past_magic=False).via(
    "bug: OverflowError from zstandard for a numel past ssize_t"
)
def test_any_bytes_and_numel_decode_or_raise_codec_error(name: str, payload: bytes, numel: int, past_magic: bool) -> None:
    codec = get_codec(name)
    if past_magic and name != "fp32" and len(payload) >= 2:  # the right magic byte and version
        magic = MAGIC["zstd" if name.endswith("+zstd") else name]
        payload = bytes([magic, VERSION]) + payload[2:]
    got = decode(codec, payload, numel)
    if not 0 <= numel <= MAX_NUMEL:
        assert isinstance(got, CodecError)


@st.composite
def well_formed(draw: st.DrawFn, base: str, numel: int) -> bytes:
    """A payload of ``base`` for ``numel`` elements with the right header and length and
    random contents: random parameters, scales and levels (nan, inf and negative ones too),
    codes and positions, so the decoder's checks past the header get exercised."""
    body = lambda n: draw(st.binary(min_size=n, max_size=n))  # noqa: E731
    if base == "fp32":
        return body(4 * numel)
    if base in ("fp16", "bf16"):
        param = draw(st.one_of(st.just(0), st.integers(0, 0xFFFF)))
        return pack_header(base, param, numel) + body(2 * numel)
    if base in ("int8", "int4", "e3m0"):
        block = draw(st.one_of(st.integers(1, 8), st.integers(0, 0xFFFF)))
        n_blocks = ceil_div(numel, block) if block else 0
        scales = draw(st.lists(st.one_of(st.floats(0, 2.0**100, width=32), ANY_FLOAT32), min_size=n_blocks, max_size=n_blocks))
        codes = body(numel if base == "int8" else ceil_div(numel, 2))
        return pack_header(base, block, numel) + struct.pack(f"<{n_blocks}f", *scales) + codes
    assert base == "topk2bit"
    k = draw(st.integers(0, numel))
    block = draw(st.one_of(st.integers(32, 64), st.integers(0, 2**32 - 1)))
    fmt = draw(st.one_of(st.just(index_format(numel, k)[0]), st.integers(0, 0xFFFF)))
    n_blocks = ceil_div(numel, block) if block else 0
    if n_blocks > 1000:
        n_blocks = 1  # a block size below 32 is refused before the levels are read
    levels = draw(st.lists(st.one_of(st.floats(0, 2.0**100, width=32), ANY_FLOAT32), min_size=2 * n_blocks, max_size=2 * n_blocks))
    rest = ceil_div(k, 4) + index_bytes(numel, k, fmt if fmt <= 31 or fmt == BITMAP else BITMAP)
    if draw(st.booleans()):  # valid positions, so the levels and codes get decoded too
        positions = np.array(sorted(draw(st.sets(st.integers(0, max(numel - 1, 0)), min_size=k, max_size=k))), dtype=np.int64)
        tail = body(ceil_div(k, 4)) + encode_positions(positions, numel, index_format(numel, k)[0])
    else:
        tail = body(rest)
    return pack_header(base, fmt, numel) + struct.pack("<II", k, block) + struct.pack(f"<{2 * n_blocks}f", *levels) + tail


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=400)
@given(name=st.sampled_from(ALL), numel=st.integers(0, 200), data=st.data())
def test_well_formed_payloads_with_random_contents_decode_or_raise_codec_error(name: str, numel: int, data: st.DataObject) -> None:
    base = name.removesuffix("+zstd")
    inner = data.draw(well_formed(base, numel))
    if name == base:
        decode(get_codec(name), inner, numel)
        return
    # The zstd stage is transparent: the same outcome as the inner payload on its own.
    width = {"fp32": 4, "fp16": 2, "bf16": 2}.get(base, 1)
    start = HEADER_BYTES if base in ("fp16", "bf16") else 0
    shuffled = inner
    if width > 1 and (len(inner) - start) % width == 0:
        planes = np.frombuffer(inner, dtype=np.uint8, offset=start).reshape(-1, width).T
        shuffled = inner[:start] + planes.tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=data.draw(st.booleans())).compress(shuffled)
    plain, zstd = decode(get_codec(base), inner, numel), decode(get_codec(name), bytes([MAGIC["zstd"], VERSION, width, 0]) + frame, numel)
    assert isinstance(plain, CodecError) == isinstance(zstd, CodecError), (plain, zstd)
    if not isinstance(plain, CodecError):
        assert torch.equal(plain.view(torch.int32), zstd.view(torch.int32))


# ---- a valid payload, damaged ----------------------------------------------------------------


@st.composite
def codec_with_params(draw: st.DrawFn) -> Any:
    name = draw(st.sampled_from(ALL))
    base = name.removesuffix("+zstd")
    kw: dict[str, Any] = {}
    if base in ("int8", "int4", "e3m0"):
        kw["block"] = draw(st.sampled_from([None, 1, 3, 16, 0xFFFF]))
    elif base == "topk2bit":
        kw["block"] = draw(st.sampled_from([None, 32, 45]))
        kw["density"] = draw(st.sampled_from([None, 0.01, 0.3, 1.0]))
    return make_codec(name, **{k: v for k, v in kw.items() if v is not None})


DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=3)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("numel"), st.integers(-2, 2)),
)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=400)
@given(codec=codec_with_params(), x=arrays(np.float32, st.integers(0, 200), elements=FLOAT32), damage=DAMAGE)
@example(codec=get_codec("fp32+zstd"), x=np.zeros(0, np.float32), damage=("extend", b"\x00")).via(
    "bug: zstandard returns b'' for a frame declaring no content, ignoring what follows"
)
def test_damaged_payloads_decode_or_raise_codec_error(codec: Any, x: np.ndarray, damage: tuple[str, Any]) -> None:
    payload, numel = codec.encode(torch.from_numpy(x)), x.size
    kind, arg = damage
    if kind == "flip":
        b = bytearray(payload)
        for pos, mask in arg:
            if b:
                b[pos % len(b)] ^= mask
        got = decode(codec, bytes(b), numel)
    elif kind == "numel":
        assume(arg != 0)
        got = decode(codec, payload, numel + arg)
        assert isinstance(got, CodecError)  # a header, or fp32's exact length, pins the count
    else:
        assume(payload or kind == "extend")  # fp32 of no elements: nothing to cut
        cut = payload[: arg % len(payload)] if kind == "truncate" else payload + arg
        got = decode(codec, cut, numel)
        assert isinstance(got, CodecError)  # every payload's length is exact


# ---- encode -> decode ------------------------------------------------------------------------


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """Each element's block absmax (float64)."""
    a = np.abs(x.astype(np.float64))
    out = np.empty_like(a)
    for i in range(0, a.size, block):
        out[i : i + block] = a[i : i + block].max()
    return out


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(codec=codec_with_params(), x=arrays(np.float32, st.integers(0, 300), elements=FLOAT32))
@example(codec=get_codec("fp16"), x=np.array([2.0**39, 1.0], np.float32)).via("bug: fp16's documented bound said absmax * 2**-40")
@example(codec=get_codec("bf16"), x=np.array([5.38694e-40], np.float32)).via("bug: bf16's documented bound ignored subnormals")
@example(codec=get_codec("int8"), x=np.array([2.307e-41], np.float32)).via("bug: int8's documented bound ignored subnormal scales")
def test_round_trip_keeps_shape_finiteness_and_the_documented_error_bound(codec: Any, x: np.ndarray) -> None:
    payload = codec.encode(torch.from_numpy(x.copy()))
    inner = getattr(codec, "inner", codec)
    if inner is codec:
        assert len(payload) == codec.encoded_size(x.size)
    assert len(payload) <= codec.encoded_size(x.size) <= codec.max_encoded_size(x.size)
    y = get_codec(codec.name).decode(payload, x.size)  # the receiver's default instance
    assert y.dtype == torch.float32 and y.shape == (x.size,) and torch.isfinite(y).all()
    x64, err = x.astype(np.float64), np.abs(y.numpy().astype(np.float64) - x.astype(np.float64))
    base = inner.name
    tiny = 2.0**-149  # float32's smallest subnormal: rounding of a scale near it
    if base == "fp32":
        assert y.numpy().tobytes() == x.tobytes()  # every bit, -0.0 included
    elif base == "bf16":
        assert (err <= np.maximum(2.0**-8 * np.abs(x64), 2.0**-134)).all()
    elif base == "fp16" and x.size:
        absmax = np.abs(x64).max()
        assert (err <= np.maximum(2.0**-11 * np.abs(x64), absmax * 2.0**-39) + tiny).all()
    elif base in ("int8", "int4", "e3m0"):
        a = _blocks(x, inner.block)
        slack = a * 2.0**-21 + inner.max_code * tiny + 2 * tiny  # float32 rounding; a subnormal scale
        bound = {"int8": a / 254, "int4": a / 14, "e3m0": np.maximum(np.abs(x64) / 3, a / 128)}[base]
        assert (err <= bound + slack).all(), (err - bound - slack).max()
    elif base == "topk2bit":
        kept = np.count_nonzero(y.numpy())
        assert kept <= inner.k_for(x.size)
        assert (np.sign(y.numpy()) * np.sign(x) >= 0).all()  # a kept value keeps its sign


# ---- zstd: no bomb ---------------------------------------------------------------------------


def frame_declaring(size: int, body: bytes) -> bytes:
    """A zstd frame header that declares ``size`` bytes of content (8-byte field, single
    segment), followed by ``body`` as its blocks."""
    return ZSTD_FRAME_MAGIC + bytes([0xE0]) + size.to_bytes(8, "little") + body


RLE_BLOCK = bytes([0x03, 0x00, 0x20, 0x00])  # last block, RLE, 128 KiB of byte 0


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=60)
@given(
    name=st.sampled_from([n for n in ALL if n.endswith("+zstd")]),
    numel=st.one_of(st.integers(0, 1000), st.integers(0, MAX_NUMEL), st.just(MAX_NUMEL)),
    declared=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([1 << 20, 1 << 30, 1 << 33])),
    body=st.sampled_from([b"", RLE_BLOCK, RLE_BLOCK[:3], bytes(20)]),
)
@example(name="int8+zstd", numel=2**31, declared=10 << 30, body=RLE_BLOCK).via(
    "bug: a 17-byte frame declaring 10 GiB made zstd allocate 10 GiB for numel 2**31"
)
def test_a_tiny_frame_never_inflates_past_what_it_can_hold(name: str, numel: int, declared: int, body: bytes) -> None:
    codec = get_codec(name)
    payload = codec.encode(torch.zeros(1))[:4] + frame_declaring(declared, body)
    assert peak_bytes(lambda: decode(codec, payload, numel)) <= 32768 * len(payload) + (256 << 10)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=40)
@given(
    name=st.sampled_from([n for n in ALL if n.endswith("+zstd")]),
    numel=st.one_of(st.integers(0, 1000), st.integers(0, MAX_NUMEL)),
    content=st.integers(0, 4 << 20),
    with_size=st.booleans(),
)
def test_a_frame_of_real_content_is_refused_past_what_numel_allows(name: str, numel: int, content: int, with_size: bool) -> None:
    codec = get_codec(name)
    frame = zstandard.ZstdCompressor(write_content_size=with_size).compress(bytes(content))
    payload = codec.encode(torch.zeros(1))[:4] + frame
    limit = codec.inner.max_encoded_size(numel)
    got: list[Any] = []
    peak = peak_bytes(lambda: got.append(decode(codec, payload, numel)))
    if content > limit:
        assert isinstance(got[0], CodecError)
    assert peak <= 4 * min(limit, content) + (1 << 20)  # the frame inflated, unshuffled, decoded


# ---- the codec header and the sparse index ----------------------------------------------------


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(
    codec=st.sampled_from(sorted(MAGIC)),
    param=st.integers(0, 0xFFFF),
    numel=st.integers(0, MAX_NUMEL),
    tail=st.binary(max_size=8),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, HEADER_BYTES - 1), st.integers(1, 255))),
)
def test_header_round_trips_and_any_damage_to_it_is_named(codec: str, param: int, numel: int, tail: bytes, damage: tuple[int, int] | None) -> None:
    payload = bytearray(pack_header(codec, param, numel) + tail)
    if damage is None:
        assert parse_header(codec, bytes(payload), numel) == param
        return
    at, mask = damage
    payload[at] ^= mask
    fields = HEADER.unpack_from(payload)
    try:
        got = parse_header(codec, bytes(payload), numel)
    except CodecError as e:
        assert ("magic" in str(e)) == (at == 0) and ("version" in str(e)) == (at == 1)
        assert ("declares" in str(e)) == (at >= 4)
        return
    assert 2 <= at <= 3 and got == fields[2]  # only the parameter is free; the codec checks it


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=200)
@given(codec=st.sampled_from(sorted(MAGIC)), payload=st.binary(max_size=12), numel=NUMEL)
def test_parse_header_of_any_bytes_returns_a_u16_or_raises_codec_error(codec: str, payload: bytes, numel: int) -> None:
    try:
        param = parse_header(codec, payload, numel)
    except CodecError as e:
        assert len(str(e)) <= MAX_MESSAGE
        return
    assert 0 <= param <= 0xFFFF and 0 <= numel <= MAX_NUMEL and payload[0] == MAGIC[codec]


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(n=st.integers(1, 2000), data=st.data())
def test_positions_round_trip_in_every_index_format(n: int, data: st.DataObject) -> None:
    positions = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=min(n, 100)))), dtype=np.int64)
    k = positions.size
    for fmt in (BITMAP, index_format(n, k)[0], data.draw(st.integers(0, 31))):
        coded = encode_positions(positions, n, fmt)
        assert len(coded) == index_bytes(n, k, fmt)
        assert np.array_equal(decode_positions(b"pad" + coded, 3, n, k, fmt, "test"), positions)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(n=st.integers(0, 3000), k=st.integers(0, 3000), fmt=st.one_of(st.just(BITMAP), st.integers(0, 31)), data=st.data())
def test_decode_positions_of_any_bits_is_sorted_distinct_in_range_or_refused(n: int, k: int, fmt: int, data: st.DataObject) -> None:
    assume(n > 0 or fmt == BITMAP)
    raw = data.draw(st.binary(min_size=index_bytes(n, k, fmt), max_size=index_bytes(n, k, fmt)))
    try:
        p = decode_positions(raw, 0, n, k, fmt, "test")
    except CodecError:
        return
    assert p.dtype == np.int64 and p.size == k
    assert (p >= 0).all() and (p < n).all() and (np.diff(p) > 0).all()


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=100)
@given(name=st.one_of(st.sampled_from(ALL), st.text(max_size=12), st.just("n" * 100_000)))
def test_get_codec_of_any_name_is_a_codec_or_a_short_codec_error(name: str) -> None:
    try:
        codec = get_codec(name)
    except CodecError as e:
        assert "unknown codec" in str(e) and len(str(e)) <= MAX_MESSAGE
        return
    assert codec.name == name
