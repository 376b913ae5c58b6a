"""What the coordinator records of its commits (Coordinator.commit_timings): each commit timed by
its parts, and the push that closed it named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks, fingerprint

pytestmark = pytest.mark.timeout(60)


def test_the_coordinator_times_each_commit_and_names_the_push_that_closed_it(tmp_path: Path) -> None:
    theta = {"w": torch.ones(3, 4), "b": torch.zeros(4)}
    coord = Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=2, min_sites=2, checkpoint_dir=str(tmp_path)))
    for s in ("a", "b"):
        coord.join(JoinRequest(s, tuple(fingerprint(theta).values())))
    for s in ("a", "b"):
        delta = {n: torch.full_like(p, 0.01) for n, p in theta.items()}
        coord.push(PushHeader(site_id=s, round=0, tokens=10, train_loss=1.0, inner_steps=1), encode_chunks(delta, codec=get_codec("fp32")))
    (t,) = coord.commit_timings()
    assert t["round"] == 0 and t["closer"] == "b"
    for k in ("receive_s", "lock_s", "commit_s", "mean_s", "step_s", "encode_s", "record_s", "checkpoint_s", "publish_s"):
        assert t[k] >= 0.0, k
    assert t["commit_s"] >= t["mean_s"] + t["step_s"]
