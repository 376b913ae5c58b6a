"""Chunks to and from wire bytes (diloco.transport.serde): chunks written by hand are
protobuf's bytes, and a pushed chunk is read as protobuf reads it, whatever its encoding."""

from __future__ import annotations

import random

import pytest

from diloco.transport import serde
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.types import Chunk

pytestmark = pytest.mark.timeout(60)


def test_chunks_written_by_hand_are_protobufs_bytes() -> None:
    rng = random.Random(0)
    for _ in range(500):
        c = Chunk(
            name=rng.choice(["", "w", "layers.0.attn.q.weight", "é" * rng.randint(0, 80)]), shape=tuple(rng.randint(-3, 1 << 40) for _ in range(rng.randint(0, 4))),
            dtype=rng.choice(["", "float32"]), offset=rng.choice([0, 1, 127, 128, 1 << 33, -5]), numel=rng.choice([0, 5, 300, 262144]), codec=rng.choice(["", "fp32", "int8+zstd"]),
            payload=rng.randbytes(rng.choice([0, 1, 127, 128, 300, 20000])), box_start=tuple(rng.randint(0, 500) for _ in range(rng.randint(0, 3))),
            box_shape=tuple(rng.randint(0, 500) for _ in range(rng.randint(0, 3))),
        )  # fmt: skip
        assert serde.chunk_to_wire(c) == serde.chunk_to_proto(c).SerializeToString()
        assert serde.global_chunk_to_wire(c) == pb.GlobalMessage(chunk=serde.chunk_to_proto(c)).SerializeToString()
        assert serde.push_chunk_to_wire(c) == pb.PushMessage(chunk=serde.chunk_to_proto(c)).SerializeToString()
        assert serde.push_message_to_wire(c) == serde.push_chunk_to_wire(c)
        assert serde.chunk_from_proto(pb.TensorChunk.FromString(serde.chunk_to_wire(c))) == c


def test_a_pushed_chunk_is_read_as_protobuf_reads_it_whatever_its_encoding() -> None:
    from google.protobuf.message import DecodeError

    rng = random.Random(1)

    def parsed(data: bytes) -> object:
        try:
            got = serde.push_message_from_wire(data)
        except DecodeError:
            return "DecodeError"
        return got if isinstance(got, Chunk) else (serde.chunk_from_proto(got.chunk) if got.WhichOneof("kind") == "chunk" else got.WhichOneof("kind"))

    def reference(data: bytes) -> object:
        try:
            m = pb.PushMessage.FromString(data)
        except DecodeError:
            return "DecodeError"
        return serde.chunk_from_proto(m.chunk) if m.WhichOneof("kind") == "chunk" else m.WhichOneof("kind")

    c = Chunk(name="layer.w", shape=(4, 3), dtype="float32", offset=2, numel=10, codec="fp32", payload=bytes(range(40)), box_start=(1, 0), box_shape=(2, 3))
    canonical = pb.PushMessage(chunk=serde.chunk_to_proto(c)).SerializeToString()
    body = canonical[2:]
    odd = [
        canonical,
        b"\x12" + bytes([len(body) + 4]) + body + b"\x20\x05" + b"\x28\x07",  # offset and numel again: the last wins
        b"\x12" + bytes([len(body) + 3]) + b"\x1a\x01x" + body,  # dtype before name
        b"\x12" + bytes([len(body) + 2]) + body + b"\x60\x01",  # an unknown field
        b"\x12" + bytes([len(body) + 4]) + body + b"\x48\x05\x48\x06",  # box_start unpacked
        b"\x12\x03\x0a\x01\xff",  # a name that is not UTF-8
        b"\x0a\x02\x08\x01",  # a header
        b"",
        b"\x12",
        b"\x12\x05\x0a",
    ]
    odd += [bytes(rng.randrange(256) for _ in range(rng.randint(0, 60))) for _ in range(400)]
    odd += [canonical[: rng.randint(0, len(canonical))] for _ in range(100)]
    for data in odd:
        assert parsed(data) == reference(data), data
    assert isinstance(serde.push_message_from_wire(canonical), Chunk)


def test_the_clients_own_push_calls_name_the_stubs_methods() -> None:
    """CoordinatorClient calls PushDelta and UploadInit by path, with its own serializer: the
    paths are those the generated stub uses."""
    from diloco.transport import client
    from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc

    class Channel:
        def __init__(self) -> None:
            self.paths: list[str] = []

        def __getattr__(self, kind: str):
            return lambda path, **_: self.paths.append(path)

    channel = Channel()
    pb_grpc.CoordinatorStub(channel)
    assert client._PUSH_DELTA in channel.paths and client._UPLOAD_INIT in channel.paths
