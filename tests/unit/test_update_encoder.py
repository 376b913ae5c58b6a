"""The coordinator's downlink encoder (diloco.coordinator.commit.UpdateEncoder): a lossless
downlink sends exactly the update, without decoding it again."""

from __future__ import annotations

import pytest
import torch
from helpers import generator as _g

from diloco.codec import get_codec
from diloco.coordinator.commit import UpdateEncoder
from diloco.types import Chunk
from diloco.wire import ChunkAssembler, fingerprint

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("codec", ["fp32", "fp32+zstd"])
def test_a_lossless_downlink_sends_exactly_the_update_without_decoding_it_again(codec: str) -> None:
    u = {"a": torch.randn(300, 5, generator=_g()), "b": torch.tensor([-0.0, 1e-45, 3.4e38])}
    specs = fingerprint(u)
    sent: list[list[Chunk]] = []
    out = UpdateEncoder.of(get_codec(codec), specs, 1 << 12, True).transmit(u, sent.append)
    assert out is u
    assembler = ChunkAssembler(specs)
    for c in sent[0]:
        assembler.add(c)
    got = assembler.finish()
    assert all(torch.equal(got[n].view(torch.int32), u[n].view(torch.int32)) for n in u)  # bit for bit, -0.0 included
