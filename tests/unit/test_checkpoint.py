"""Atomic checkpoints: a crash before the rename leaves the old one in use; corrupt and
truncated files are detected, named, and the previous good one is loaded."""

import os
from pathlib import Path

import pytest
import torch

from diloco import checkpoint as ck
from diloco.types import JoinRequest

pytestmark = pytest.mark.timeout(30)


def _state(r: int) -> dict:
    return {"round": r, "theta": {"w": torch.full((3, 2), float(r))}, "members": {"a": {"state": "active", "joins": 1}}}


def test_round_trip_and_pruning(tmp_path: Path) -> None:
    for r in range(4):
        ck.save_checkpoint(tmp_path, r, _state(r), keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["ckpt-00000002.pt", "ckpt-00000003.pt"]
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.round == 3 and loaded.problems == []
    assert torch.equal(loaded.state["theta"]["w"], torch.full((3, 2), 3.0))
    assert loaded.state["members"] == {"a": {"state": "active", "joins": 1}}
    assert ck.load_latest(tmp_path / "nothing") is None


def test_crash_between_write_and_rename_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch) -> None:
    ck.save_checkpoint(tmp_path, 1, _state(1))

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ck.save_checkpoint(tmp_path, 2, _state(2))
    monkeypatch.undo()
    # A temporary file left by a real crash (killed mid-write) is never taken for a checkpoint.
    (tmp_path / ".ckpt-00000002.pt.abc.tmp").write_bytes(b"half")
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.round == 1 and loaded.problems == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        (lambda b: b"XXXX" + b[4:], "not a diloco checkpoint"),
        (lambda b: b[:10], "shorter than the 48-byte header"),
    ],
)
def test_bad_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path: Path, damage, message: str) -> None:
    ck.save_checkpoint(tmp_path, 1, _state(1))
    newest = ck.save_checkpoint(tmp_path, 2, _state(2))
    newest.write_bytes(damage(newest.read_bytes()))
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.round == 1
    assert len(loaded.problems) == 1 and newest.name in loaded.problems[0] and message in loaded.problems[0]
    with pytest.raises(ck.CheckpointError, match=message):
        ck.read_checkpoint(newest)


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    only = ck.save_checkpoint(tmp_path, 5, _state(5))
    only.write_bytes(only.read_bytes()[:-3])
    with pytest.raises(ck.CheckpointError, match="no usable checkpoint: .*ckpt-00000005.pt"):
        ck.load_latest(tmp_path)


def test_a_restarted_coordinator_resumes_bit_identically(tmp_path: Path) -> None:
    """Kill-and-restart at the library level: a new Coordinator restored from the last
    checkpoint continues exactly as the old one would (θ, momentum, downlink residual)."""
    from diloco.codec import get_codec
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.outer import OuterConfig
    from diloco.types import PushHeader
    from diloco.wire import encode_chunks
    from diloco.wire.fingerprint import fingerprint

    theta = {"w": torch.linspace(-1, 1, 24).reshape(4, 6), "b": torch.zeros(6)}
    cfg = CoordinatorConfig(total_rounds=4, min_sites=2, codec_down="int8", checkpoint_dir=str(tmp_path / "ck"))

    def push_round(coord: Coordinator, r: int) -> None:
        for i, site in enumerate(("a", "b")):
            g = torch.Generator().manual_seed(10 * r + i)
            delta = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in theta.items()}
            header = PushHeader(site_id=site, round=r, tokens=10 + i, train_loss=1.0, inner_steps=1)
            assert coord.push(header, encode_chunks(delta, codec=get_codec("int8"))).accepted

    first = Coordinator(theta, OuterConfig(), cfg)
    for s in ("a", "b"):
        first.join(JoinRequest(s, tuple(fingerprint(theta).values())))
    for r in range(2):
        push_round(first, r)
    assert first.committed_rounds == 2
    loaded = ck.load_latest(tmp_path / "ck")
    assert loaded is not None and loaded.round == 2

    second = Coordinator(theta, OuterConfig(), cfg)  # a fresh process would start from θ_0
    second.restore(loaded.state)
    assert second.global_sha256() == first.global_sha256() and second.committed_rounds == 2
    assert second.run_id == first.run_id and second.active_sites == {"a", "b"}
    for coord in (first, second):
        push_round(coord, 2)
    assert second.global_sha256() == first.global_sha256()  # momentum and residual came back too

    bad = dict(loaded.state, global_sha256="0" * 64)
    with pytest.raises(ValueError, match="hashes to"):
        Coordinator(theta, OuterConfig(), cfg).restore(bad)
