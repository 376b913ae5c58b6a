"""Pushes repeated across a coordinator restart, late pushes, the loss-spike guard, and the
metrics file a restarted coordinator repairs. In-process (no gRPC): the fault matrix
(test_fault_matrix.py) runs the same paths through real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import coordinator, join, push, random_delta

from diloco import checkpoint as ck
from diloco.app.metrics import MetricsReporter
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.guard import GuardConfig, SpikeGuard
from diloco.coordinator.round_policy import QuorumConfig
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, apply_update, params_sha256
from diloco.wire import ChunkAssembler
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

THETA = {"w": torch.linspace(-1, 1, 24).reshape(4, 6), "b": torch.zeros(6)}
SITES = ("a", "b")


def _checkpointing_coordinator(tmp_path: Path, outer: OuterConfig | None = None, **kwargs) -> Coordinator:
    """Sites a and b joined, checkpoints in tmp_path/ck; ``kwargs``: CoordinatorConfig's fields
    and QuorumConfig's late, late_discount, max_staleness and lease_s."""
    quorum = {k: kwargs.pop(k) for k in ("late", "late_discount", "max_staleness", "lease_s") if k in kwargs}
    cfg = CoordinatorConfig(**{"total_rounds": 6, "min_sites": 2, "checkpoint_dir": str(tmp_path / "ck"), "quorum": QuorumConfig(**quorum), **kwargs})
    return coordinator(THETA, cfg, outer=outer, sites=SITES)


def _restarted(tmp_path: Path, **kwargs) -> Coordinator:
    """A new process on the same checkpoint directory."""
    loaded = ck.load_latest(tmp_path / "ck")
    assert loaded is not None
    coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=6, min_sites=2, checkpoint_dir=str(tmp_path / "ck"), **kwargs))
    coord.restore(loaded.state)
    return coord


def _seeded_delta(site: str, r: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    """Site ``site``'s Δ of round ``r``: the same whichever coordinator it is pushed to."""
    return random_delta(THETA, seed=100 * r + ord(site), scale=scale)


def _push_seeded(coord: Coordinator, site: str, r: int, scale: float = 0.01):
    return push(coord, site, r, _seeded_delta(site, r, scale))


def test_pushes_repeated_after_a_restart_are_taken_once(tmp_path: Path) -> None:
    reference = _checkpointing_coordinator(tmp_path / "ref")
    crashed = _checkpointing_coordinator(tmp_path)
    for coord in (reference, crashed):
        _push_seeded(coord, "a", 0)
        _push_seeded(coord, "b", 0)
        _push_seeded(coord, "a", 1)  # round 1 is open: this push lives only in memory
    assert crashed.committed_rounds == 1
    restarted = _restarted(tmp_path)
    assert restarted.committed_rounds == 1 and restarted.global_sha256() == reference.global_sha256()
    # Site b repeats its counted push of round 0: "duplicate", nothing changes.
    again = _push_seeded(restarted, "b", 0)
    assert again.duplicate and not again.accepted and restarted.committed_rounds == 1
    # Site a's push of round 1 was lost with the crash: its repeat is taken (not a duplicate).
    assert _push_seeded(restarted, "a", 1).accepted
    assert _push_seeded(restarted, "a", 1).duplicate
    _push_seeded(restarted, "b", 1)
    _push_seeded(reference, "b", 1)
    assert restarted.committed_rounds == 2 and restarted.global_sha256() == reference.global_sha256()
    # The update of round 0 is gone with the old process: a site asking for it is told to pull θ.
    with pytest.raises(CoordinatorError, match="no longer kept") as info:
        restarted.pull_update("a", 0)
    assert info.value.kind == "not_found"


def test_a_late_push_is_refused_recorded_and_changes_nothing(tmp_path: Path) -> None:
    coord = _checkpointing_coordinator(tmp_path, min_sites=1)
    coord.leave("b", "")  # only a is active: round 0 closes on its push
    _push_seeded(coord, "a", 0)
    join(coord, THETA, "b")
    before = coord.global_sha256()
    with pytest.raises(CoordinatorError, match="committed without site 'b'") as info:
        _push_seeded(coord, "b", 0)
    assert info.value.kind == "aborted" and coord.global_sha256() == before
    assert coord.late_pushes(1) == [{"site": "b", "round": 0}]  # recorded in the round open when it came


def test_spike_guard_judges_against_the_median_of_accepted_rounds() -> None:
    guard = SpikeGuard(GuardConfig(factor=3.0, window=3, min_rounds=2))
    assert guard.judge(1.0).accepted and guard.judge(100.0).accepted  # too few rounds to judge yet
    v = guard.judge(200.0)  # median(1, 100) = 50.5: limit 151.5
    assert not v.accepted and v.limit == pytest.approx(151.5) and "limit 151.5" in v.describe()
    assert guard.history == [1.0, 100.0]  # a rejected norm does not enter the history
    assert not guard.judge(float("nan")).accepted
    with pytest.raises(ValueError, match="guard.factor"):
        GuardConfig(factor=0.5)
    with pytest.raises(ValueError, match="guard.min_rounds"):
        GuardConfig(window=2, min_rounds=3)


def test_a_rejected_round_leaves_theta_and_sites_stay_identical(tmp_path: Path) -> None:
    coord = _checkpointing_coordinator(tmp_path, guard=GuardConfig(factor=3.0, window=3, min_rounds=2))
    records = []
    coord.on_commit.append(records.append)
    site = {n: t.clone() for n, t in THETA.items()}

    def round_(r: int, scale: float) -> None:
        _push_seeded(coord, "a", r, scale)
        _push_seeded(coord, "b", r, scale)
        asm = ChunkAssembler(fingerprint(site))
        for c in coord.pull_update("a", r):
            asm.add(c)
        apply_update(site, asm.finish())
        assert params_sha256(site) == coord.global_sha256()

    for r in range(3):
        round_(r, 0.01)
    before = coord.global_sha256()
    round_(3, 10.0)  # a spike: ~1000 x the usual norm
    assert records[3].rejected and "limit" in records[3].guard and records[3].update_norm == 0.0
    assert coord.global_sha256() == before and coord.committed_rounds == 4
    round_(4, 0.01)  # training goes on
    assert not records[4].rejected and coord.global_sha256() != before


def test_a_restarted_coordinator_repairs_metrics_jsonl(tmp_path: Path) -> None:
    coord = _checkpointing_coordinator(tmp_path)
    for r in range(3):
        _push_seeded(coord, "a", r)
        _push_seeded(coord, "b", r)
    # The killed predecessor had written round 0's line and half of round 1's.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"round": 0, "participants": ["a", "b"]}) + "\n" + '{"round": 1, "partic')
    restarted = _restarted(tmp_path)
    reporter = MetricsReporter(metrics, restarted, evaluate=lambda params: 0.0, log=lambda msg: None)
    reporter.close()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2]
    assert all(m["recovered"] and m["participants"] == ["a", "b"] and m["bytes_down"] is None for m in lines[1:])
    assert lines[2]["global_sha256"] == restarted.global_sha256()


def test_a_late_push_is_merged_into_the_open_round_with_a_discount(tmp_path: Path) -> None:
    # Outer SGD with lr 1 and no momentum: θ moves by exactly minus the weighted mean Δ.
    sgd = OuterConfig(lr=1.0, momentum=0.0, nesterov=False)
    coord = _checkpointing_coordinator(tmp_path, outer=sgd, min_sites=1, late="merge", late_discount=0.5, max_staleness=2)
    records = []
    coord.on_commit.append(records.append)
    coord.leave("b", "")
    _push_seeded(coord, "a", 0)  # round 0 closes with a alone
    join(coord, THETA, "b")
    theta1 = coord.global_params()
    merged = _push_seeded(coord, "b", 0)  # one round late: merged into round 1 with weight 10 x 0.5
    assert merged.accepted and merged.merged_into == 1
    assert _push_seeded(coord, "b", 0).duplicate  # a repeat of a merged push changes nothing
    _push_seeded(coord, "a", 1)
    _push_seeded(coord, "b", 1)
    delta = {(site, r): _seeded_delta(site, r) for site, r in (("a", 1), ("b", 1), ("b", 0))}
    expected = {n: theta1[n] - (10 * delta["a", 1][n] + 10 * delta["b", 1][n] + 5 * delta["b", 0][n]) / 25 for n in THETA}
    got = coord.global_params()
    assert all(torch.allclose(got[n], expected[n], atol=1e-7, rtol=0) for n in THETA)
    assert records[1].merged == [{"site": "b", "round": 0, "weight": 0.5, "tokens": 10}]
    assert records[1].participants == ["a", "b"]


def test_a_push_later_than_max_staleness_is_dropped_even_with_merge(tmp_path: Path) -> None:
    coord = _checkpointing_coordinator(tmp_path, min_sites=1, late="merge", max_staleness=1)
    coord.leave("b", "")
    _push_seeded(coord, "a", 0)
    _push_seeded(coord, "a", 1)
    join(coord, THETA, "b")
    with pytest.raises(CoordinatorError, match="committed without site 'b'"):
        _push_seeded(coord, "b", 0)  # two rounds late


def test_a_commit_is_published_only_after_its_checkpoint_and_the_write_holds_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the checkpoint of round 0 is being written, the coordinator still answers (heartbeats,
    joins, waits), shows round 0 as open, and gives out no θ; once it is durable, round 0 is
    published: it is on disk before any site can see it."""
    import threading

    from diloco.coordinator import service

    writing, release = threading.Event(), threading.Event()
    real_save = service.save_checkpoint

    def slow_save(directory: Path, round: int, state: dict) -> Path:
        if round == 1:
            writing.set()
            assert release.wait(30)
        return real_save(directory, round, state)

    monkeypatch.setattr(service, "save_checkpoint", slow_save)
    coord = _checkpointing_coordinator(tmp_path)
    assert _push_seeded(coord, "a", 0).accepted
    closing = threading.Thread(target=_push_seeded, args=(coord, "b", 0))  # the last push: it commits round 0
    closing.start()
    try:
        assert writing.wait(30)
        # The lock is free while the checkpoint is written: these return at once, round 0 still open.
        assert coord.heartbeat("a").committed_rounds == 0
        assert coord.wait_round("a", 0, timeout_s=0.2).committed_rounds == 0
        join(coord, THETA, "c")
        with pytest.raises(CoordinatorError, match="round 0 is not committed yet"):
            coord.pull_update("a", 0)
        assert ck.load_latest(tmp_path / "ck") is None or ck.load_latest(tmp_path / "ck").round == 0  # type: ignore[union-attr]
        pulled: list[int] = []
        puller = threading.Thread(target=lambda: pulled.append(coord.pull_global("c")[0].committed_rounds))
        puller.start()
        puller.join(0.5)
        assert puller.is_alive() and not pulled  # θ is moving: a pull of it waits for the publication
    finally:
        release.set()
        closing.join(30)
    puller.join(30)
    assert pulled == [1] and coord.committed_rounds == 1
    loaded = ck.load_latest(tmp_path / "ck")
    assert loaded is not None and loaded.round == 1 and loaded.state["global_sha256"] == coord.global_sha256()
