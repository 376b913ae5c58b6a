"""Chunking tensors for the wire: size limits, reassembly, and header checks."""

import pytest
import torch

from diloco.codec import CodecError, get_codec
from diloco.types import Chunk
from diloco.wire import ChunkAssembler, encode_chunks
from diloco.wire.chunks import MAX_CHUNK_BYTES
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(30)
FP32 = get_codec("fp32")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(700, 1000, generator=g), "small": torch.randn(3, generator=g), "scalar": torch.tensor(2.5)}


def test_chunks_are_at_most_1mib_and_reassemble_exactly() -> None:
    t = _tensors()
    chunks = list(encode_chunks(t, codec=FP32))
    assert max(len(c.payload) for c in chunks) <= MAX_CHUNK_BYTES
    assert sum(c.name == "big" for c in chunks) == 3  # 2.8 MB of float32 in 1 MiB pieces
    asm = ChunkAssembler(fingerprint(t))
    for c in chunks:
        asm.add(c)
    out = asm.finish()
    assert asm.payload_bytes == 4 * sum(x.numel() for x in t.values())
    for n in t:
        assert torch.equal(out[n], t[n])


def test_small_chunk_bytes_and_bad_limits() -> None:
    t = {"w": torch.arange(10, dtype=torch.float32)}
    chunks = list(encode_chunks(t, codec=FP32, chunk_bytes=12))
    assert [c.numel for c in chunks] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(encode_chunks(t, codec=FP32, chunk_bytes=MAX_CHUNK_BYTES + 1))


def _chunk(**kw: object) -> Chunk:
    base = dict(name="w", shape=(4,), dtype="float32", offset=0, numel=4, codec="fp32", payload=FP32.encode(torch.ones(4)))
    base.update(kw)
    return Chunk(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (_chunk(name="nope"), "unknown parameter 'nope'"),
        (_chunk(shape=(2, 2)), "shape"),
        (_chunk(dtype="float16"), "dtype"),
        (_chunk(offset=1, numel=3, payload=FP32.encode(torch.ones(3))), "starts at element 1"),
        (_chunk(numel=5, payload=FP32.encode(torch.ones(5))), "covers elements"),
        (_chunk(payload=FP32.encode(torch.ones(4))[:-1]), "15 bytes"),
        (_chunk(codec="zip9"), "unknown codec 'zip9'"),
        (_chunk(payload=FP32.encode(torch.tensor([1.0, float("nan"), 1.0, float("inf")]))), "non-finite"),
    ],
)
def test_assembler_rejects_bad_chunks(chunk: Chunk, message: str) -> None:
    asm = ChunkAssembler(fingerprint({"w": torch.zeros(4)}))
    with pytest.raises(CodecError, match=message):
        asm.add(chunk)


def test_assembler_rejects_incomplete_and_repeated_tensors() -> None:
    specs = fingerprint({"w": torch.zeros(4), "v": torch.zeros(2)})
    asm = ChunkAssembler(specs)
    asm.add(_chunk(numel=2, payload=FP32.encode(torch.ones(2))))
    with pytest.raises(CodecError, match="incomplete: 2 parameter"):
        asm.finish()
    asm2 = ChunkAssembler(specs)
    asm2.add(_chunk())
    with pytest.raises(CodecError, match="starts at element 0, expected 4"):
        asm2.add(_chunk())
