"""scripts/bench_coordinator.py: its synthetic θ holds exactly the parameters asked for, and its
arguments are refused before any process starts where they cannot run (more than one
coordinator shard, a tree without the coordinator)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_coordinator  # noqa: E402


@pytest.mark.parametrize("params", [2048, 5_000_000, 4_196_352, 100_000_000])
def test_theta_holds_the_parameters_asked_for(params: int) -> None:
    shapes = bench_coordinator.theta_shapes(params)
    assert sum(math.prod(s) for s in shapes.values()) == params
    assert all(s == (2048, 2048) for n, s in shapes.items() if n.endswith(".weight"))


def test_the_plans() -> None:
    rates = bench_coordinator.parse(["rates", "--params", "5e6", "--codecs", "fp32,int8", "--sites", "2"])
    assert rates.plan == [("fp32", 2), ("int8", 2)] and rates.params == 5_000_000
    sites = bench_coordinator.parse(["sites", "--sites-list", "1,2,4"])
    assert sites.plan == [("int8", 1), ("int8", 2), ("int8", 4)] and sites.params == 100_000_000


def test_shards_go_to_the_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_coordinator.parse(["sites", "--shards", "2"]).shards == 2
    with pytest.raises(SystemExit):
        bench_coordinator.parse(["sites", "--shards", "0"])
    assert "--shards 0" in capsys.readouterr().err


def test_a_tree_without_the_coordinator_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_coordinator.parse(["rates", "--coordinator-pythonpath", str(tmp_path)])
    assert "no diloco/cli/coordinator.py" in capsys.readouterr().err
