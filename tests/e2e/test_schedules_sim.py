"""Schedules through real processes and real gRPC: sites follow a sync_every schedule in
lock-step (each round's steps, bit-identical θ everywhere) under an outer lr and momentum
warm-up; the data-parallel baseline trains the same blocks, so tokens stay equal."""

from __future__ import annotations

import pytest
from helpers import run_ok

pytestmark = pytest.mark.timeout(240)

ARGS = ["sites=2", "sync.every=4", "rounds=4", "sync.schedule=[1,2,4]", "data.batch_size=4", "eval_every=100", "sim.plots=false"]


def test_sites_follow_the_sync_every_schedule_in_lock_step(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = run_ok(tmp_path_factory.mktemp("sched") / "run", *ARGS, "outer.lr_warmup=2", "outer.momentum_warmup=3", "outer.lr_decay=cosine", timeout=200)
    assert run.summary["hashes_equal"] is True
    # Every round took both sites' pushes, each of that round's H.
    assert [m["inner_steps"] for m in run.metrics] == [2, 4, 8, 8]
    assert all(m["participants"] == ["0", "1"] for m in run.metrics)
    per_step = run.metrics[0]["tokens"] // 2
    assert [m["tokens"] for m in run.metrics] == [2 * per_step * h for h in (1, 2, 4, 4)]
    assert all(w["inner_steps"] == 11 for w in run.workers().values())
    ddp = run_ok(tmp_path_factory.mktemp("sched_ddp") / "run", *ARGS, "mode=ddp", timeout=200)
    assert [m["tokens"] for m in ddp.metrics] == [m["tokens"] for m in run.metrics]  # equal tokens, round by round
