"""The observers read the coordinator, a site's outer sync and its round loop through the
protocols of diloco.observe.watched: the real classes have every member those protocols name
(runtime checks), so a rename fails here rather than in a dashboard."""

from __future__ import annotations

import torch
from torch import nn

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.commit import RoundRecord
from diloco.observe.watched import CommitRecord, LoopCounts, SyncCounts, WatchedCoordinator, WatchedLoop, WatchedSync
from diloco.outer import OuterConfig
from diloco.site.loop import RoundLoop
from diloco.site.outer_sync import OuterSync
from diloco.sync import SyncConfig, SyncSchedule


def test_the_coordinator_is_what_the_observers_watch() -> None:
    coord = Coordinator({"w": torch.zeros(2)}, OuterConfig(), CoordinatorConfig(total_rounds=1))
    assert isinstance(coord, WatchedCoordinator)
    assert (coord.cfg.total_rounds, coord.cfg.checkpoint_dir) == (1, None)  # CoordinatorSetup
    record = RoundRecord(
        round=0, participants=[], tokens=0, inner_steps=0, bytes_up=0, train_loss=None, update_norm=0.0, global_sha256="", wall_s=0.0, elapsed_s=0.0
    )
    assert isinstance(record, CommitRecord)


def test_a_sites_sync_and_loop_are_what_the_observers_watch() -> None:
    sync = OuterSync(nn.Linear(2, 2), client=None, site_id="0")  # type: ignore[arg-type]  (no call is made)
    loop = RoundLoop(sync, SyncSchedule(SyncConfig(every=1)), lambda _r, _s: 0.0, tokens_per_step=1)
    assert isinstance(sync, WatchedSync) and isinstance(sync.stats, SyncCounts)
    assert isinstance(loop, WatchedLoop) and isinstance(loop.stats, LoopCounts)
