"""Codecs: round-trip error bounds, exact sizes, chunk limits, error feedback, hostile payloads."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard
from helpers import peak_bytes

from diloco.codec import CodecError, get_codec, known_codecs, make_codec
from diloco.codec.sparse_index import BITMAP, index_format
from diloco.wire import ChunkAssembler, encode_chunks
from diloco.wire.chunks import MAX_CHUNK_BYTES
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

BASES = ["fp32", "fp16", "bf16", "int8", "int4", "e3m0", "topk2bit"]
ALL = [b + s for b in BASES for s in ("", "+zstd")]
HEADERED = [n for n in ALL if not n.startswith("fp32")]  # fp32 is raw bytes
QUANTIZERS = ["int8", "int4", "e3m0", "topk2bit"]
KINDS = ["normal", "zeros", "constant", "tiny", "huge"]


def _base(name: str) -> str:
    return name.removesuffix("+zstd")


def _block(name: str) -> int:
    return {"int8": 1024, "int4": 128, "e3m0": 1024, "topk2bit": 4096}.get(_base(name), 1024)


def _data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "constant":
        return torch.full((n,), -0.37)
    scale = {"normal": 1.0, "tiny": 1e-30, "huge": 1e30}[kind]
    return torch.randn(n, generator=g) * scale


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, expanded to x's length."""
    n = x.numel()
    padded = torch.cat([x.abs(), torch.zeros(-n % block)]).view(-1, block)
    return padded.amax(dim=1).repeat_interleave(block)[:n]


def _assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    base, n = _base(name), x.numel()
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert torch.isfinite(y).all()
    x64, err = x.double(), (y.double() - x.double()).abs()
    slack = 1 + 1e-6  # float32 rounding of the scale itself
    if base == "fp32":
        assert torch.equal(x, y)
        return
    if base == "topk2bit":
        b = _block(name)
        for s in range(0, n, b):  # top-k and levels are per block
            _assert_topk(x[s : s + b], y[s : s + b], get_codec("topk2bit").k_for(min(b, n - s)))
        return
    if base == "fp16":
        bound = 2.0**-11 * x64.abs() + 2.0**-39 * (float(x64.abs().max()) if n else 0.0)
    elif base == "bf16":
        bound = 2.0**-8 * x64.abs()
    else:
        a = _block_absmax(x, _block(name)).double()
        bound = {"int8": a / 254, "int4": a / 14, "e3m0": torch.maximum(x64.abs() / 3, a / 128)}[base]
        bound = bound + a * 2.0**-21  # float32 rounding of x / absmax, of the scale, of code * scale
    bad = err > bound * slack + 1e-45
    assert not bad.any(), f"{name}: {int(bad.sum())} of {n} values off, worst err {float(err.max()):.3g}"


def _assert_topk(x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """Dropped values decode to exactly 0; the kept ones are k largest in magnitude, keep
    their sign and take the nearer of two magnitudes."""
    kept = y != 0
    assert int(kept.sum()) <= k
    if x.numel() == 0:
        return
    mags = x.abs()
    threshold, top = float(torch.topk(mags, k).values[-1]), float(mags.max())
    if threshold > 0:  # both levels are means of kept magnitudes >= threshold, so nonzero
        assert int(kept.sum()) == k
    else:
        assert top > 0 or not kept.any()
    assert (mags[kept] >= threshold).all()
    if kept.any():
        signed = x[kept] != 0
        assert (torch.sign(y[kept][signed]) == torch.sign(x[kept][signed])).all()
        levels = torch.unique(y[kept].abs())
        assert levels.numel() <= 2, "2-bit values: at most two magnitudes"
        lo, hi = float(levels.min()), float(levels.max())
        bound = max(lo - threshold, top - hi, (hi - lo) / 2)
        err = (y[kept] - x[kept]).abs()
        assert float(err.max()) <= bound * (1 + 1e-6) + 1e-45
        other = torch.where(y[kept].abs() == hi, lo, hi)
        assert ((x[kept].abs() - y[kept].abs()).abs() <= (x[kept].abs() - other).abs() * (1 + 1e-6)).all()


# ---------------------------------------------------------------- round trips and sizes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ALL)
def test_round_trip_within_codec_bound(name: str, kind: str) -> None:
    codec = get_codec(name)
    b = _block(name)
    for n in (0, 1, 7, b - 1, b, b + 1, 3 * b + 5):
        x = _data(kind, n, seed=n)
        payload = codec.encode(x)
        assert isinstance(payload, bytes)
        y = codec.decode(payload, n)
        _assert_within_bound(name, x, y)
        if kind == "zeros":
            assert torch.equal(y, torch.zeros(n)), f"{name}: zeros must decode to exact zeros (n={n})"
        if "+zstd" in name:
            assert len(payload) <= codec.encoded_size(n)
        else:
            assert len(payload) == codec.encoded_size(n), f"{name}: n={n}"


def _formula(name: str, n: int) -> int:
    """The documented sizes, computed independently of the codecs."""
    base = _base(name)
    b = _block(name)
    if base == "fp32":
        return 4 * n
    if base in ("fp16", "bf16"):
        return 8 + 2 * n
    if base == "int8":
        return 8 + 4 * math.ceil(n / b) + n
    if base in ("int4", "e3m0"):
        return 8 + 4 * math.ceil(n / b) + math.ceil(n / 2)
    lengths = [b] * (n // b) + ([n % b] if n % b else [])
    k = sum(max(1, math.ceil(0.02 * m - 1e-9)) for m in lengths)
    index = math.ceil(n / 8)
    if n:
        for low in range(32):
            index = min(index, math.ceil(k * low / 8) + math.ceil((k + ((n - 1) >> low) + 1) / 8))
    return 16 + 8 * len(lengths) + math.ceil(k / 4) + index


@pytest.mark.parametrize("name", [n for n in ALL if "+zstd" not in n])
def test_encoded_size_matches_documented_formula(name: str) -> None:
    codec = get_codec(name)
    for n in (0, 1, 2, 7, 100, 127, 128, 129, 1000, 1023, 1024, 1025, 5000, 100_003):
        assert codec.encoded_size(n) == _formula(name, n), f"{name}: n={n}"
        assert codec.max_encoded_size(n) >= codec.encoded_size(n)
    for n in (0, 1, 7, 1000, 5000):
        assert len(codec.encode(torch.randn(n))) == _formula(name, n)


def test_topk_size_worked_example() -> None:
    # n=1000, k=20: Elias-Fano with L=5 takes ceil(100/8) + ceil((20 + 31 + 1)/8) = 13 + 7 bytes,
    # less than the 125-byte bitmap; plus 16 bytes of header, k and block, 8 bytes of the one
    # block's levels and ceil(20/4) value bytes.
    codec = get_codec("topk2bit")
    assert codec.k_for(1000) == 20
    assert index_format(1000, 20) == (5, 20)
    assert codec.encoded_size(1000) == 49
    assert index_format(1000, 300)[0] == BITMAP
    # n=10000 in blocks of 4096: 82 + 82 + ceil(0.02 x 1808) = 201 kept, three pairs of levels
    assert codec.k_for(10000) == 201 and codec.encoded_size(10000) == 16 + 24 + 51 + index_format(10000, 201)[1]


@pytest.mark.parametrize("name", ALL)
def test_max_chunk_numel_fits_one_mib(name: str) -> None:
    codec = get_codec(name)
    m = codec.max_chunk_numel(MAX_CHUNK_BYTES)
    assert codec.encoded_size(m) <= MAX_CHUNK_BYTES
    if _base(name) in ("int8", "int4", "e3m0", "topk2bit"):  # chunks hold whole blocks
        assert m % _block(name) == 0
        assert codec.encoded_size(m + _block(name)) > MAX_CHUNK_BYTES
    else:
        assert codec.encoded_size(m + 1) > MAX_CHUNK_BYTES
    if m <= 4_000_000:  # really encode it (randn is the least compressible case we have)
        assert len(codec.encode(torch.randn(m, generator=torch.Generator().manual_seed(0)))) <= MAX_CHUNK_BYTES
    # sizes never shrink as numel grows, so every shorter last chunk fits too
    sizes = [codec.encoded_size(n) for n in range(0, 5000)]
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("name", ALL)
def test_chunked_tensors_reassemble(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(50, 300, generator=g), "b": torch.randn(7, generator=g)}
    codec = get_codec(name)
    limit = 256 if _base(name) == "topk2bit" else 4096  # top-k of 2% packs 4096 bytes with 170k values
    chunks = list(encode_chunks(tensors, codec=codec, chunk_bytes=limit))
    assert all(len(c.payload) <= limit and c.codec == name for c in chunks)
    assert sum(c.name == "w" for c in chunks) > 1
    asm = ChunkAssembler(fingerprint(tensors))
    for c in chunks:
        asm.add(c)
    out = asm.finish()
    for key, t in tensors.items():
        if _base(name) == "topk2bit":
            kept = sum(get_codec("topk2bit").k_for(c.numel) for c in chunks if c.name == key)
            assert 0 < int((out[key] != 0).sum()) <= kept
        else:
            rel = float((out[key] - t).norm() / t.norm())
            assert rel <= {"fp32": 0, "fp16": 1e-3, "bf16": 1e-2, "int8": 1e-2, "int4": 0.15, "e3m0": 0.25}[_base(name)]


@pytest.mark.parametrize("name", ALL)
def test_deterministic(name: str) -> None:
    codec = get_codec(name)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    assert codec.encode(x) == codec.encode(x.clone())
    p = codec.encode(x)
    assert torch.equal(codec.decode(p, 3000), codec.decode(p, 3000))


# ---------------------------------------------------------------- codec specifics


def test_int8_zero_block_next_to_data_is_exact_and_scale_zero() -> None:
    x = torch.cat([torch.zeros(1024), torch.randn(1024)])
    p = get_codec("int8").encode(x)
    scales = np.frombuffer(p, dtype="<f4", count=2, offset=8)
    assert scales[0] == 0 and scales[1] > 0
    assert torch.equal(get_codec("int8").decode(p, 2048)[:1024], torch.zeros(1024))


def test_e3m0_levels_and_rounding() -> None:
    a = 4.0
    ratios = [1, 0.75, 0.74, 0.5, 0.25, 1 / 64, 0.75 / 64, 0.6 / 64, 1 / 128, 0.99 / 128, 0, -0.3, -0.001]
    expect = [1, 1, 0.5, 0.5, 0.25, 1 / 64, 1 / 64, 1 / 64, 1 / 64, 0, 0, -0.25, 0]
    x = torch.tensor(ratios) * a
    y = get_codec("e3m0").decode(get_codec("e3m0").encode(x), x.numel())
    assert y.tolist() == pytest.approx([e * a for e in expect])
    assert not torch.signbit(y[-1]), "a negative value rounding to zero decodes to +0"


def test_int4_codes_are_symmetric() -> None:
    x = torch.tensor([-7.0, -3.5, -1, 0, 1, 3.5, 7])
    y = get_codec("int4").decode(get_codec("int4").encode(x), 7)
    assert y.tolist() == [-7, -4, -1, 0, 1, 4, 7]  # round half to even of 3.5 is 4


@pytest.mark.parametrize("name", ALL)
def test_no_overflow_near_float32_max(name: str) -> None:
    big = float(torch.finfo(torch.float32).max)
    x = torch.tensor([big, -big, 1.0, 3.3e38, -3e38] + [1e38] * 60)
    y = get_codec(name).decode(get_codec(name).encode(x), x.numel())
    assert torch.isfinite(y).all()
    if _base(name) != "topk2bit":
        _assert_within_bound(name, x, y)


def test_fp16_scale_keeps_small_values_precise() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 1e-6  # plain fp16 would be subnormal
    y = get_codec("fp16").decode(get_codec("fp16").encode(x), 1000)
    assert float(((y - x).abs() / x.abs()).max()) <= 2.0**-11 * 1.0001


def test_topk_density_parameters_and_both_index_formats() -> None:
    assert make_codec("topk2bit", density=0.07).k_for(100) == 7  # exact, not ceil(7.000000000000001)
    assert get_codec("topk2bit").k_for(1) == 1 and get_codec("topk2bit").k_for(0) == 0
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    for density in (0.01, 0.3, 1.0):
        codec = make_codec("topk2bit", density=density)
        k = codec.k_for(1000)
        y = get_codec("topk2bit").decode(codec.encode(x), 1000)  # the default instance reads any k
        _assert_topk(x, y, k)
        assert int((y != 0).sum()) == k


def test_topk_selects_per_block_with_levels_per_block() -> None:
    g = torch.Generator().manual_seed(8)
    loud, quiet = 100 * torch.randn(4096, generator=g), 0.01 * torch.randn(3000, generator=g)
    x = torch.cat([loud, quiet])
    y = get_codec("topk2bit").decode(get_codec("topk2bit").encode(x), x.numel())
    # every block keeps its own share, the quiet one too, with magnitudes of its own
    assert int((y[:4096] != 0).sum()) == 82 and int((y[4096:] != 0).sum()) == 60
    assert float(y[4096:].abs().max()) < 0.1
    whole = make_codec("topk2bit", block=1 << 20)  # one block: the quiet values never make it
    assert int((whole.decode(whole.encode(x), x.numel())[4096:] != 0).sum()) == 0
    # the block size travels in the payload: any instance decodes any block size
    small = make_codec("topk2bit", block=1024)
    assert torch.equal(get_codec("topk2bit").decode(small.encode(x), x.numel()), small.decode(small.encode(x), x.numel()))
    assert small.k_for(x.numel()) == 6 * 21 + 20  # 6 full blocks of 1024 (ceil 20.48) and one of 952 (ceil 19.04)
    with pytest.raises(ValueError, match="block=16 must be an integer of at least 32"):
        make_codec("topk2bit", block=16)


def test_topk_levels_minimize_squared_error() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2500, generator=g) * torch.rand(2500, generator=g) ** 3  # skewed magnitudes
    codec = get_codec("topk2bit")
    y = codec.decode(codec.encode(x), 2500)
    kept = np.sort(x[y != 0].abs().double().numpy())
    assert kept.size == codec.k_for(2500) == 50
    best = min(
        (((kept[:s] - kept[:s].mean()) ** 2).sum() + ((kept[s:] - kept[s:].mean()) ** 2).sum(), kept[:s].mean(), kept[s:].mean()) for s in range(1, kept.size)
    )
    assert sorted(set(y[y != 0].abs().tolist())) == pytest.approx([best[1], best[2]], rel=1e-6)


def test_byte_plane_shuffle_helps_zstd_on_floats() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    for name in ("fp32", "fp16", "bf16"):
        plain = zstandard.ZstdCompressor(level=3).compress(get_codec(name).encode(x))
        assert len(get_codec(name + "+zstd").encode(x)) < 0.97 * len(plain)


def test_topk_levels_are_two_means() -> None:
    # Kept magnitudes 10 x 1.0 and 2 x 5.0 (with sign): the levels are exactly those means.
    x = torch.zeros(600)
    x[:10] = torch.tensor([1.0, -1.0] * 5)
    x[100] = 5.0
    x[200] = -5.0
    y = get_codec("topk2bit").decode(get_codec("topk2bit").encode(x), 600)
    assert torch.equal(y, x)


def test_parameters_travel_in_the_header() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6))
    for sender in (make_codec("int8", block=64), make_codec("int4", block=7), make_codec("e3m0", block=1), make_codec("int8+zstd", block=300, zstd_level=19)):
        receiver = get_codec(sender.name)
        assert receiver is not sender
        assert torch.equal(receiver.decode(sender.encode(x), 5000), sender.decode(sender.encode(x), 5000))
    small_blocks = make_codec("int4", block=16)
    assert float((small_blocks.decode(small_blocks.encode(x), 5000) - x).norm()) < float(
        (get_codec("int4").decode(get_codec("int4").encode(x), 5000) - x).norm()
    )


def test_make_codec_rejects_parameters_that_do_not_apply() -> None:
    with pytest.raises(ValueError, match="takes no block"):
        make_codec("fp16", block=64)
    with pytest.raises(ValueError, match="takes no density"):
        make_codec("int8", density=0.1)
    with pytest.raises(ValueError, match="takes no zstd level"):
        make_codec("int8", zstd_level=3)
    with pytest.raises(ValueError, match="block=0"):
        make_codec("int8", block=0)
    with pytest.raises(ValueError, match="block=65536"):
        make_codec("int4", block=65536)
    with pytest.raises(ValueError, match="density=0"):
        make_codec("topk2bit", density=0)
    with pytest.raises(ValueError, match="level=99"):
        make_codec("fp32+zstd", zstd_level=99)


def test_unknown_names_list_the_known_ones() -> None:
    assert sorted(ALL) == known_codecs()
    for bad in ("int3", "int8+zstd+zstd", "zstd", "INT8"):
        with pytest.raises(CodecError, match=r"unknown codec .*known codecs: .*int8\+zstd.*topk2bit"):
            get_codec(bad)
        with pytest.raises(CodecError, match="known codecs"):
            make_codec(bad)


@pytest.mark.parametrize("name", HEADERED)
def test_non_finite_input_is_refused(name: str) -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3000)
        x[1234] = bad
        with pytest.raises(CodecError, match="non-finite"):
            get_codec(name).encode(x)


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", QUANTIZERS + ["int4+zstd", "topk2bit+zstd"])
def test_error_feedback_keeps_the_running_sum_close(name: str) -> None:
    codec, n, g = get_codec(name), 4096, torch.Generator().manual_seed(1)
    residual = torch.zeros(n)
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    no_feedback_gap = torch.zeros(n, dtype=torch.float64)
    gaps = []
    for _ in range(200):
        x = torch.randn(n, generator=g)
        v = x + residual
        sent = codec.decode(codec.encode(v), n)
        residual = v - sent
        true_sum += x
        sent_sum += sent
        gap = true_sum - sent_sum
        gaps.append(float(gap.abs().max()))
        assert float((gap - residual).abs().max()) < 1e-3  # the gap is exactly the residual
        if _base(name) != "topk2bit":  # bounded by this one step's quantization error
            _assert_within_bound(name, v, sent)
        no_feedback_gap += x.double() - codec.decode(codec.encode(x), n).double()
    assert max(gaps[150:]) <= 1.25 * max(gaps[50:100]), f"{name}: the gap grows: {gaps[::25]}"
    assert gaps[-1] < 0.25 * float(no_feedback_gap.abs().max())


# ---------------------------------------------------------------- hostile payloads


@pytest.mark.parametrize("name", ALL)
def test_truncated_or_padded_payloads_are_rejected(name: str) -> None:
    codec = get_codec(name)
    p = codec.encode(torch.randn(1000))
    for bad in (p[:-1], p[: len(p) // 2], p[:3], b"", p + b"\0"):
        with pytest.raises(CodecError, match=r"bytes|frame|header"):
            codec.decode(bad, 1000)


@pytest.mark.parametrize("name", ALL)
def test_payload_for_another_numel_is_rejected(name: str) -> None:
    codec = get_codec(name)
    p = codec.encode(torch.randn(100))
    for wrong in (99, 101, 0, 200):
        with pytest.raises(CodecError, match=r"declares 100 elements|bytes|at most"):
            codec.decode(p, wrong)
    with pytest.raises(CodecError):
        codec.decode(p, -1)


@pytest.mark.parametrize("name", HEADERED)
def test_wrong_magic_or_version_is_rejected(name: str) -> None:
    codec = get_codec(name)
    p = bytearray(codec.encode(torch.randn(100)))
    for at, what in ((0, "magic byte"), (1, "layout version")):
        bad = bytearray(p)
        bad[at] ^= 0x40
        with pytest.raises(CodecError, match=what):
            codec.decode(bytes(bad), 100)


def test_payload_of_another_codec_is_rejected() -> None:
    p = get_codec("int4").encode(torch.randn(100))
    with pytest.raises(CodecError, match="magic byte 0x14, expected 0xe3"):
        get_codec("e3m0").decode(p, 100)


def test_blockwise_header_checks() -> None:
    codec = get_codec("int8")
    p = codec.encode(torch.randn(3000))
    with pytest.raises(CodecError, match="in blocks of 512"):
        codec.decode(p[:2] + struct.pack("<H", 512) + p[4:], 3000)
    with pytest.raises(CodecError, match="block size 0"):
        codec.decode(p[:2] + struct.pack("<H", 0) + p[4:], 3000)
    for scale in (-1.0, float("nan"), float("inf")):
        with pytest.raises(CodecError, match="scale .* in block 1"):
            codec.decode(p[:12] + struct.pack("<f", scale) + p[16:], 3000)
    odd = get_codec("int4").encode(torch.randn(7))
    with pytest.raises(CodecError, match="padding nibble"):
        get_codec("int4").decode(odd[:-1] + bytes([odd[-1] | 0x30]), 7)


def test_fp16_and_bf16_header_checks() -> None:
    p = get_codec("fp16").encode(torch.randn(10))
    with pytest.raises(CodecError, match="scale exponent 200"):
        get_codec("fp16").decode(p[:2] + struct.pack("<h", 200) + p[4:], 10)
    q = get_codec("bf16").encode(torch.randn(10))
    with pytest.raises(CodecError, match="parameter 5"):
        get_codec("bf16").decode(q[:2] + struct.pack("<H", 5) + q[4:], 10)


def test_topk_header_checks() -> None:
    codec = get_codec("topk2bit")
    p = codec.encode(torch.randn(1000))  # k=20, Elias-Fano L=5
    with pytest.raises(CodecError, match="k=21"):
        codec.decode(p[:8] + struct.pack("<I", 21) + p[12:], 1000)
    with pytest.raises(CodecError, match="k=5000 kept values, more than"):
        codec.decode(p[:8] + struct.pack("<I", 5000) + p[12:], 1000)
    with pytest.raises(CodecError, match="block=8; blocks have at least 32"):
        codec.decode(p[:12] + struct.pack("<I", 8) + p[16:], 1000)
    with pytest.raises(CodecError, match="in blocks of 500"):  # two blocks need two pairs of levels
        codec.decode(p[:12] + struct.pack("<I", 500) + p[16:], 1000)
    with pytest.raises(CodecError, match="index format 6, expected 5"):
        codec.decode(p[:2] + struct.pack("<H", 6) + p[4:], 1000)
    with pytest.raises(CodecError, match="levels"):
        codec.decode(p[:16] + struct.pack("<ff", 2.0, 1.0) + p[24:], 1000)
    with pytest.raises(CodecError, match="levels"):
        codec.decode(p[:16] + struct.pack("<ff", 0.5, float("nan")) + p[24:], 1000)
    # an upper bitvector with a position too many (set the last padding bit)
    with pytest.raises(CodecError, match="upper bitvector"):
        codec.decode(p[:-1] + bytes([p[-1] | 0x80]), 1000)
    dense = make_codec("topk2bit", density=0.5).encode(torch.randn(100))
    with pytest.raises(CodecError, match="bitmap marks"):
        get_codec("topk2bit").decode(dense[:-1] + bytes([dense[-1] ^ 0x01]), 100)


@pytest.mark.parametrize("with_size", [True, False])
def test_zstd_bomb_is_refused_without_inflating(with_size: bool) -> None:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=with_size).compress(bytes(100_000_000))
    assert len(frame) < 10_000
    for name in ("int8+zstd", "fp32+zstd", "topk2bit+zstd"):
        codec = get_codec(name)
        payload = codec.encode(torch.zeros(10))[:4] + frame

        def decode(codec=codec, payload=payload) -> None:  # type: ignore[no-untyped-def]
            with pytest.raises(CodecError, match="declares 100000000 bytes" if with_size else "over"):
                codec.decode(payload, 10)

        assert peak_bytes(decode) < 1_000_000


@pytest.mark.parametrize("name", [n for n in ALL if "+zstd" in n])
def test_zstd_corrupt_or_trailing_frames_are_rejected(name: str) -> None:
    codec = get_codec(name)
    p = codec.encode(torch.randn(500))
    with pytest.raises(CodecError, match="not a zstd frame"):
        codec.decode(p[:4] + b"\x00" * 40, 500)
    with pytest.raises(CodecError, match="corrupt zstd frame"):
        codec.decode(p + p[4:], 500)  # a second frame after the first
    with pytest.raises(CodecError, match="byte-plane width"):
        codec.decode(p[:2] + bytes([3]) + p[3:], 500)
    # a well-formed frame whose content is not a valid inner payload
    wrong = zstandard.ZstdCompressor().compress(b"\x01" * 30)
    with pytest.raises(CodecError):
        codec.decode(p[:4] + wrong, 500)


@pytest.mark.parametrize("name", ALL)
def test_random_corruption_raises_codec_error_or_decodes(name: str) -> None:
    codec = get_codec(name)
    rng = np.random.default_rng(7)
    p = np.frombuffer(codec.encode(torch.randn(777, generator=torch.Generator().manual_seed(8))), dtype=np.uint8)
    for _ in range(300):
        bad = p.copy()
        at = rng.integers(0, len(bad), size=rng.integers(1, 4))
        bad[at] ^= rng.integers(1, 256, size=at.size, dtype=np.uint8)
        try:
            y = codec.decode(bad.tobytes(), 777)
        except CodecError:
            continue
        assert y.dtype == torch.float32 and y.shape == (777,)


def test_error_feedback_decay_scales_the_carried_residual() -> None:
    from diloco.outer import ErrorFeedback

    delta = {"w": torch.tensor([1.0, -2.0])}
    residual = {"w": torch.tensor([0.5, 0.25])}
    for decay, want in ((1.0, [1.5, -1.75]), (0.5, [1.25, -1.875]), (0.0, [1.0, -2.0])):
        feedback = ErrorFeedback(decay)
        assert torch.equal(feedback.compensate(delta)["w"], delta["w"])  # nothing carried yet
        feedback.carry(residual)
        assert torch.equal(feedback.compensate(delta)["w"], torch.tensor(want))
    with pytest.raises(ValueError, match="decay=1.5"):
        ErrorFeedback(1.5)
