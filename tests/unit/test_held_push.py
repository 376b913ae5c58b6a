"""diloco.wire.held: a push kept as its payloads and added into float64 sums from them (the
coordinator's fused intake) gives the very sums of decoding it into float32 and adding that, for
every codec, bundle and slice; a bad chunk is refused naming it, before anything is added."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import generator as _g

from diloco.codec import CodecError, get_codec
from diloco.codec.blockwise import Int8Codec
from diloco.outer import WeightedMean
from diloco.wire import ChunkAssembler, bundle_chunks, encode_chunks, fingerprint
from diloco.wire.held import HeldPush

pytestmark = pytest.mark.timeout(60)

SHAPES = {"a": (1000, 33), "b": (7,), "c": (4099,), "empty": (0, 5)}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = _g(seed)
    return {n: torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-6, 2, (), generator=g)) for n, s in SHAPES.items()}


def _held(chunks, specs) -> HeldPush:
    held = HeldPush(specs)
    for c in chunks:
        held.add(c)
    return held.finish()


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "e3m0", "topk2bit", "int8+zstd", "bf16"])
def test_held_pushes_sum_to_the_bits_of_decoded_ones(codec: str) -> None:
    specs = fingerprint(_delta(0))
    fused, decoded = WeightedMean({n: torch.Size(s) for n, s in SHAPES.items()}), WeightedMean({n: torch.Size(s) for n, s in SHAPES.items()})
    for seed, weight in ((1, 1000.0), (2, 37.0), (3, 0.625)):
        chunks = list(encode_chunks(_delta(seed), codec=get_codec(codec), chunk_bytes=4096))
        if seed == 2:
            chunks = bundle_chunks(chunks, 1 << 20)  # small chunks travel bundled
        fused.add_with(_held(chunks, specs).accumulate_into, weight)
        assembler = ChunkAssembler(specs)
        for c in chunks:
            assembler.add(c)
        decoded.add(assembler.finish(), weight)
    for n, t in fused.mean().items():
        assert torch.equal(t, decoded.mean()[n]), n


def test_the_c_loops_and_the_torch_path_add_the_same_bits() -> None:
    x = torch.randn(70_001, generator=_g(4)) * 1e-3
    torch_path = Int8Codec()
    torch_path.use_native = False
    for codec in (get_codec("int8"), torch_path, get_codec("fp32"), get_codec("int4"), get_codec("e3m0")):
        payload = codec.encode(x)
        codec.check_payload(payload, x.numel())
        out = torch.full((x.numel(),), 0.5, dtype=torch.float64)
        codec.accumulate(payload, x.numel(), out, 3.0)
        assert torch.equal(out, torch.full((x.numel(),), 0.5, dtype=torch.float64).add_(codec.decode(payload, x.numel()), alpha=3.0))


def test_slices_of_a_tensor_are_added_into_their_boxes() -> None:
    from diloco.boxes import Box

    delta = _delta(5)
    specs = fingerprint(delta)
    halves = {"a": [Box((0, 0), (400, 33)), Box((400, 0), (600, 33))], "c": [Box((0,), (4099,))]}
    chunks = []
    for name, boxes in halves.items():
        for box in boxes:
            chunks += encode_chunks({name: delta[name][box.slices()].contiguous()}, codec=get_codec("int8"), boxes={name: (box, SHAPES[name])})
    chunks += encode_chunks({n: delta[n] for n in ("b", "empty")}, codec=get_codec("int8"))
    sums = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    _held(chunks, specs).accumulate_into(sums, 2.0)
    assembler = ChunkAssembler(specs)
    for c in chunks:
        assembler.add(c)
    for n, t in assembler.finish().items():
        assert torch.equal(sums[n], torch.zeros(SHAPES[n], dtype=torch.float64).add_(t, alpha=2.0)), n


def _spoiled(codec: str, spoil) -> list:
    chunks = list(encode_chunks(_delta(6), codec=get_codec(codec), chunk_bytes=4096))
    chunks[3] = dataclasses.replace(chunks[3], payload=spoil(bytearray(chunks[3].payload)))
    return chunks


def _nan_at(i: int):
    def spoil(p: bytearray) -> bytes:
        p[i : i + 4] = np.float32("nan").tobytes()
        return bytes(p)

    return spoil


@pytest.mark.parametrize(
    ("codec", "spoil", "says"),
    [
        ("fp32", _nan_at(8), "non-finite values: 1 of"),
        ("int8", _nan_at(8), "scale nan in block 0"),  # the header is 8 bytes; the first scale follows
        ("int8", lambda p: bytes(p[:8]) + np.float32(3e38).tobytes() + bytes(p[12:]), "overflows float32"),
        ("int8", lambda p: bytes(p[:-1]), "expected"),
        # a scale whose 127-fold is finite but not its 128-fold (code -128 is never written, but a payload may hold it)
        ("int8", lambda p: bytes(p[:8]) + np.float32(3.4e38 / 127.5).tobytes() + bytes(p[12:]), "times 128 overflows"),
        ("int4", lambda p: bytes(p[:8]) + np.float32(3.4e38 / 7.5).tobytes() + bytes(p[12:]), "times 8 overflows"),
    ],
)
def test_a_bad_chunk_is_refused_naming_it_and_nothing_is_added(codec: str, spoil, says: str) -> None:
    specs = fingerprint(_delta(0))
    held = HeldPush(specs)
    with pytest.raises(CodecError, match=says) as refused:
        for c in _spoiled(codec, spoil):
            held.add(c)
    assert "chunk of 'a' at elements" in str(refused.value)


def test_an_incomplete_push_is_refused_naming_what_is_missing() -> None:
    specs = fingerprint(_delta(0))
    chunks = [c for c in encode_chunks(_delta(7), codec=get_codec("int8"), chunk_bytes=4096) if c.name != "c"]
    with pytest.raises(CodecError, match="'c' missing or partial"):
        _held(chunks, specs)
