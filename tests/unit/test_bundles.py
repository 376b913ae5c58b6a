"""Bundles of small chunks (diloco.wire.bundles): they assemble to exactly what the plain chunks
do, a broken bundle is refused naming what is wrong, and the coordinator takes bundled pushes
and serves bundled pulls with the same θ."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from helpers import generator as _g

from diloco.codec import CodecError, get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.types import Chunk, JoinRequest, PushHeader
from diloco.wire import ChunkAssembler, encode_chunks, fingerprint

pytestmark = pytest.mark.timeout(60)


def _many() -> dict[str, torch.Tensor]:
    g = _g(3)
    return {f"layer{i}.{k}": torch.randn(*shape, generator=g) for i in range(6) for k, shape in (("w", (16, 8)), ("b", (8,)), ("norm", (3,)))} | {
        "emb": torch.randn(300, 300, generator=g)
    }


@pytest.mark.parametrize("codec", ["fp32", "int8", "topk2bit+zstd"])
def test_bundled_chunks_assemble_to_exactly_what_the_plain_ones_do(codec: str) -> None:
    from diloco.wire import bundle_chunks, is_bundle, unbundled

    tensors = _many()
    specs = fingerprint(tensors)
    plain = list(encode_chunks(tensors, codec=get_codec(codec), chunk_bytes=1 << 16))
    bundled = bundle_chunks(plain, 1 << 16)
    assert len(bundled) < len(plain) and any(is_bundle(c) for c in bundled) and all(len(c.payload) <= 1 << 16 for c in bundled)
    assert [(c.name, c.offset, c.numel, c.codec, bytes(c.payload)) for c in unbundled(bundled)] == [
        (c.name, c.offset, c.numel, c.codec, c.payload) for c in plain
    ]
    a, b = ChunkAssembler(specs), ChunkAssembler(specs)
    for c in plain:
        a.add(c)
    for c in bundled:
        b.add(c)
    x, y = a.finish(), b.finish()
    assert a.payload_bytes == b.payload_bytes and all(torch.equal(x[n], y[n]) for n in x)
    assert bundle_chunks(plain[:7], 1 << 16) == plain[:7]  # too few to bundle: as they were


def test_a_broken_bundle_is_refused_naming_what_is_wrong() -> None:
    from diloco.wire import bundle_chunks, is_bundle

    tensors = _many()
    specs = fingerprint(tensors)
    bundle = next(c for c in bundle_chunks(list(encode_chunks(tensors, codec=get_codec("fp32"))), 1 << 20) if is_bundle(c))
    p = bundle.payload
    nested = dataclasses.replace(bundle, numel=1, payload=b"DLBN" + (1).to_bytes(4, "little") + _frame(bundle))
    cases = [
        (dataclasses.replace(bundle, payload=p[: len(p) // 2]), "runs past the end"),
        (dataclasses.replace(bundle, payload=p + b"x"), "bytes after its"),
        (dataclasses.replace(bundle, numel=bundle.numel + 1), "the chunk declares"),
        (dataclasses.replace(bundle, payload=b"XXXX" + p[4:]), "not b'DLBN'"),
        (dataclasses.replace(bundle, name="w"), "no name, dtype"),
        (dataclasses.replace(bundle, payload=p + bytes(1 << 20)), "over the limit"),
        (nested, "a bundle inside a bundle"),
    ]
    for broken, message in cases:
        with pytest.raises(CodecError, match=message):
            assembler = ChunkAssembler(specs)
            assembler.add(broken)
    rng = random.Random(0)
    for _ in range(300):  # random damage: refused as a CodecError, never anything else
        b = bytearray(p)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            ChunkAssembler(specs).add(dataclasses.replace(bundle, payload=bytes(b[: rng.randint(0, len(b))])))
        except CodecError:
            pass


def _frame(c: Chunk) -> bytes:
    from diloco.wire import bundles

    return b"".join(bundles._framed(c))


def test_the_coordinator_takes_bundled_pushes_and_serves_bundled_pulls(tmp_path: Path) -> None:
    from diloco.wire import bundle_chunks, is_bundle

    theta = _many()
    specs = fingerprint(theta)
    coords = [
        Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=3, min_sites=2, checkpoint_dir=str(tmp_path / str(i)), bundle_downlink=bool(i)))
        for i in range(2)
    ]
    site = {n: t.clone() for n, t in theta.items()}
    for coord in coords:
        for s in ("a", "b"):
            coord.join(JoinRequest(s, tuple(specs.values())))
    for r in range(3):
        for i, s in enumerate(("a", "b")):
            g = _g(10 * r + i)
            delta = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in theta.items()}
            plain = list(encode_chunks(delta, codec=get_codec("fp32")))
            for coord, chunks in zip(coords, (plain, bundle_chunks(plain, 1 << 20))):
                assert coord.push(PushHeader(site_id=s, round=r, tokens=10, train_loss=1.0, inner_steps=1), iter(chunks)).accepted
        served = [coord.pull_update("a", r) for coord in coords]
        assert not any(is_bundle(c) for c in served[0]) and any(is_bundle(c) for c in served[1]) and len(served[1]) < len(served[0])
        assembler = ChunkAssembler(specs)
        for c in served[1]:
            assembler.add(c)
        for n, u in assembler.finish().items():
            site[n].add_(u)
        from diloco.outer import params_sha256

        assert coords[0].global_sha256() == coords[1].global_sha256() == params_sha256(site)
        assert coords[0].bytes_down(r) == coords[1].bytes_down(r)  # the tensors' payloads, framing excluded
    rows = {"emb": __import__("diloco.boxes", fromlist=["Box"]).Box((10, 0), (5, 300))}
    sliced = coords[1].pull_update("b", 2, want=rows)
    assert sliced and not any(is_bundle(c) for c in sliced) and {c.name for c in sliced} == {"emb"}
    status, chunks = coords[1].pull_global("a")
    assert any(is_bundle(c) for c in chunks)
