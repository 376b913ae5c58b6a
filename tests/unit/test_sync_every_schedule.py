"""sync.schedule: the H of the first rounds, growing to sync.every; the steps of each round
and where each round starts, by hand, and the settings a run refuses, named."""

from __future__ import annotations

import pytest

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.observe.progress import ProgressTracker, SiteStep
from diloco.sync import SyncConfig, SyncSchedule


def test_steps_by_round_and_where_each_round_starts() -> None:
    s = SyncSchedule(SyncConfig(every=50, schedule=(10, 25, 50)), train_rounds=6)
    assert [s.steps_of(r) for r in range(6)] == [10, 25, 50, 50, 50, 50]
    assert [s.steps_before(r) for r in range(7)] == [0, 10, 35, 85, 135, 185, 235]
    plain = SyncSchedule(SyncConfig(every=50), train_rounds=6)
    assert [plain.steps_before(r) for r in range(7)] == [50 * r for r in range(7)]  # no schedule: r × H, as before


def test_a_run_with_a_schedule_counts_its_steps() -> None:
    cfg = run_config_from_dict({"rounds": 6, "sync": {"every": 50, "schedule": [10, 25, 50]}})
    assert cfg.sync.schedule == (10, 25, 50) and cfg.total_steps == 235 and cfg.sync_rounds == 6
    assert run_config_from_dict({"rounds": 6, "sync": {"every": 50}}).total_steps == 300


def test_progress_follows_the_schedule() -> None:
    tracker = ProgressTracker(rounds=4, sites=2, round_steps=4, early=(1, 2, 4))
    state = tracker.update(0.0, 1, {"0": SiteStep(1, 1, 2), "1": SiteStep(1, 2, 2)})
    assert (state.round, state.done, state.total) == (1, 3, 4)  # round 1 has 2 steps per site


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"schedule": [10, 25]}, r"sync.schedule=\[10, 25\]: must end at sync.every=50"),
        ({"schedule": [10, 0, 50]}, "every entry must be an integer >= 1"),
        ({"schedule": "10,50"}, "must be a list of H values"),
        ({"schedule": [5] * 10 + [50]}, "sync.schedule has 11 entries: longer than the run's 10 rounds"),
        ({"schedule": [10, 50], "fragments": 2}, "cannot be combined with sync.fragments=2"),
        ({"schedule": [10, 50], "overlap": 1}, "cannot be combined with .*sync.overlap=1"),
        ({"schedule": [10, 50], "mode": "eager"}, "cannot be combined with .*sync.mode=eager"),
    ],
)
def test_bad_schedules_are_refused_naming_the_field(overrides: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        run_config_from_dict({"rounds": 10, "sync": {"every": 50, **overrides}})
