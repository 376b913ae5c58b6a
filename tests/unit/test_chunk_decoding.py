"""A chunk decoded on its way in: the finiteness check by a float64 sum (diloco.wire.all_finite)
agrees with torch.isfinite, fp32 decodes straight into place and checks its length, and the
assembler refuses a non-finite fp32 chunk decoded into place, naming it."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import generator as _g

from diloco.codec import CodecError, get_codec
from diloco.wire import ChunkAssembler, all_finite, encode_chunks, fingerprint

pytestmark = pytest.mark.timeout(60)


# ---- finiteness ---------------------------------------------------------------------------


def test_all_finite_agrees_with_isfinite() -> None:
    big = torch.full((1 << 16,), 3.4e38)
    cases = [torch.zeros(0), torch.randn(1000), big, -big, torch.tensor([float("inf")]), torch.tensor([1.0, float("nan")]),
             torch.tensor([float("inf"), float("-inf")]), torch.tensor([-0.0, 1e-45]), torch.randn(100).half(), torch.randn(100).bfloat16(),
             torch.tensor([1.0, float("inf")], dtype=torch.float64)]  # fmt: skip
    for i in range(50):
        t = torch.randn(997, generator=_g(i))
        t[i * 17 % 997] = random.Random(i).choice([float("inf"), float("-inf"), float("nan"), 1.0])
        cases.append(t)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t


# ---- fp32 decoded into place --------------------------------------------------------------


def test_fp32_decode_into_equals_decode_and_checks_the_length() -> None:
    codec = get_codec("fp32")
    x = torch.randn(1000, generator=_g())
    payload = codec.encode(x)
    out = torch.empty(2000)
    codec.decode_into(payload, 1000, out[500:1500])
    assert torch.equal(out[500:1500], codec.decode(payload, 1000))
    with pytest.raises(CodecError, match="expected 3996"):
        codec.decode_into(payload, 999, out[:999])
    codec.decode_into(b"", 0, out[:0])


def test_the_assembler_refuses_a_non_finite_fp32_chunk_decoded_into_place() -> None:
    x = torch.randn(10, generator=_g())
    x[3] = float("nan")
    chunks = list(encode_chunks({"w": x}, codec=get_codec("fp32")))
    assembler = ChunkAssembler(fingerprint({"w": x}))
    with pytest.raises(CodecError, match="non-finite values in 'w': 1 of 10"):
        assembler.add(chunks[0])
