"""A coordinator restarted from its checkpoint in the middle of an outer warm-up goes on with
the same learning rates and momenta: its θ is hash-equal, round after round, to that of a
coordinator that never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import coordinator, join, push, random_delta

from diloco import checkpoint as ck
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig

pytestmark = pytest.mark.timeout(60)

THETA = {"w": torch.linspace(-1, 1, 24).reshape(4, 6), "b": torch.zeros(6)}
SITES = ("a", "b")
OUTER = OuterConfig(lr_warmup=3, lr_decay="cosine", lr_min_ratio=0.1, momentum_warmup=4)
ROUNDS = 8


def _checkpointing_to(ck_dir: Path) -> CoordinatorConfig:
    return CoordinatorConfig(total_rounds=ROUNDS, min_sites=2, checkpoint_dir=str(ck_dir))


def _round(coord: Coordinator, r: int) -> None:
    """Every site pushes its seeded Δ of round ``r``, which closes the round."""
    for site in SITES:
        push(coord, site, r, random_delta(THETA, seed=100 * r + ord(site)))
    assert coord.committed_rounds == r + 1


def test_a_restart_mid_warmup_keeps_theta_hash_equal(tmp_path: Path) -> None:
    reference = coordinator(THETA, _checkpointing_to(tmp_path / "reference"), outer=OUTER, sites=SITES)
    hashes = []
    for r in range(ROUNDS):
        _round(reference, r)
        hashes.append(reference.global_sha256())
    crashed = coordinator(THETA, _checkpointing_to(tmp_path / "crashed"), outer=OUTER, sites=SITES)
    for r in range(2):  # stopped after round 1: lr and momentum both still warming up
        _round(crashed, r)
    loaded = ck.load_latest(tmp_path / "crashed")
    assert loaded is not None
    restarted = Coordinator(THETA, OUTER, _checkpointing_to(tmp_path / "crashed"))
    restarted.restore(loaded.state)
    assert restarted.global_sha256() == hashes[1]
    join(restarted, THETA, *SITES)
    for r in range(2, ROUNDS):
        _round(restarted, r)
        assert restarted.global_sha256() == hashes[r], r
    # The schedule did move θ differently from no schedule at all.
    plain = coordinator(THETA, CoordinatorConfig(total_rounds=ROUNDS, min_sites=2), sites=SITES)
    for r in range(ROUNDS):
        _round(plain, r)
    assert plain.global_sha256() != hashes[-1]
