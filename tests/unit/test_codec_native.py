"""The int8 codec's C loops (diloco/codec/_int8_native.c) against its torch path: the same
payload bytes and bit-identical decodes, so a site with the extension and a coordinator
without it (or the reverse) still agree on every update."""

from __future__ import annotations

import pytest
import torch

from diloco.codec import blockwise, make_codec
from diloco.codec.base import CodecError

pytestmark = pytest.mark.skipif(blockwise._native is None, reason="the C extension was not compiled (setup.py: optional)")


def _pair(block: int | None = None) -> tuple[blockwise.Int8Codec, blockwise.Int8Codec]:
    native = blockwise.Int8Codec(block)
    torch_path = blockwise.Int8Codec(block)
    torch_path.use_native = False
    assert native.use_native
    return native, torch_path


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(4096, generator=g)
    mixed[1500:2600] = 0.0  # a whole zero block amid others
    ties = torch.arange(-300, 300, dtype=torch.float32) * 0.5  # many x / scale land on .5
    heavy = torch.distributions.StudentT(3.0).sample((10_000,))
    return [
        ("normal", torch.randn(5000, generator=g)),
        ("zeros", torch.zeros(3000)),
        ("negative zeros", -torch.zeros(2048)),
        ("constant", torch.full((1500,), -3.0)),
        ("one value", torch.tensor([0.25])),
        ("empty", torch.zeros(0)),
        ("tiny", torch.randn(2049, generator=g) * 1e-30),
        ("huge", torch.randn(1030, generator=g) * 1e37),
        ("mixed", mixed),
        ("ties", ties),
        ("heavy tails", heavy),
        ("pseudo-gradient scale", torch.randn(65_537, generator=g) * 3e-4),
    ]


@pytest.mark.parametrize("block", [1, 7, 128, 1024, 65_535])
def test_native_and_torch_paths_give_the_same_bytes_and_values(block):
    native, torch_path = _pair(block)
    for what, x in _cases():
        payload = native.encode(x)
        assert payload == torch_path.encode(x), f"{what}: payloads differ"
        a = native.decode(payload, x.numel())
        b = torch_path.decode(payload, x.numel())
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what}: decodes differ"


def test_subnormal_blocks_take_the_general_path_with_the_same_bytes():
    # 1 / scale overflows float32 here: the C encoder hands back to the torch general path.
    native, torch_path = _pair(4)
    x = torch.tensor([1e-38, -2e-39, 0.0, 5e-40, 1.0, 2.0, 3.0, 4.0])
    assert native.encode(x) == torch_path.encode(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_by_both_paths(bad):
    x = torch.randn(3000)
    x[2500] = bad
    for codec in _pair():
        with pytest.raises(CodecError, match="non-finite"):
            codec.encode(x)


def test_registry_codec_uses_the_extension_and_bad_payloads_still_fail_first():
    codec = make_codec("int8")
    assert codec.use_native
    payload = codec.encode(torch.randn(2000))
    with pytest.raises(CodecError, match="expected"):
        codec.decode(payload[:-1], 2000)
    with pytest.raises(CodecError, match="declares 2000 elements"):
        codec.decode(payload, 1999)
