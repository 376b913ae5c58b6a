"""A coordinator restarted from its checkpoint in the middle of an outer warm-up goes on with
the same learning rates and momenta: its θ is hash-equal, round after round, to that of a
coordinator that never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco import checkpoint as ck
from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

THETA = {"w": torch.linspace(-1, 1, 24).reshape(4, 6), "b": torch.zeros(6)}
SITES = ("a", "b")
OUTER = OuterConfig(lr_warmup=3, lr_decay="cosine", lr_min_ratio=0.1, momentum_warmup=4)
ROUNDS = 8


def _coordinator(ck_dir: Path) -> Coordinator:
    coord = Coordinator(THETA, OUTER, CoordinatorConfig(total_rounds=ROUNDS, min_sites=2, checkpoint_dir=str(ck_dir)))
    for s in SITES:
        coord.join(JoinRequest(s, tuple(fingerprint(THETA).values())))
    return coord


def _round(coord: Coordinator, r: int) -> None:
    for site in SITES:
        g = torch.Generator().manual_seed(100 * r + ord(site))
        delta = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in THETA.items()}
        coord.push(PushHeader(site_id=site, round=r, tokens=10, train_loss=1.0, inner_steps=1), encode_chunks(delta, codec=get_codec("fp32")))
    assert coord.committed_rounds == r + 1


def test_a_restart_mid_warmup_keeps_theta_hash_equal(tmp_path: Path) -> None:
    reference = _coordinator(tmp_path / "reference")
    hashes = []
    for r in range(ROUNDS):
        _round(reference, r)
        hashes.append(reference.global_sha256())
    crashed = _coordinator(tmp_path / "crashed")
    for r in range(2):  # stopped after round 1: lr and momentum both still warming up
        _round(crashed, r)
    loaded = ck.load_latest(tmp_path / "crashed")
    assert loaded is not None
    restarted = Coordinator(THETA, OUTER, CoordinatorConfig(total_rounds=ROUNDS, min_sites=2, checkpoint_dir=str(tmp_path / "crashed")))
    restarted.restore(loaded.state)
    assert restarted.global_sha256() == hashes[1]
    for s in SITES:
        restarted.join(JoinRequest(s, tuple(fingerprint(THETA).values())))
    for r in range(2, ROUNDS):
        _round(restarted, r)
        assert restarted.global_sha256() == hashes[r], r
    # The schedule did move θ differently from no schedule at all.
    plain = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=ROUNDS, min_sites=2))
    for s in SITES:
        plain.join(JoinRequest(s, tuple(fingerprint(THETA).values())))
    for r in range(ROUNDS):
        _round(plain, r)
    assert plain.global_sha256() != hashes[-1]
