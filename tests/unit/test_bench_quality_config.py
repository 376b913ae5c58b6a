"""scripts/bench_quality.py turns its --set and --grid overrides into each run's config, and the
simulator's faults into run_simulation's own argument (DiLoCo runs only), refusing bad ones
before any run starts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from diloco.app.config import ConfigError

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_quality.py"
LOST = '[{"kind":"drop_push","prob":0.3,"lost":true}]'


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quality"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_quality", None)


def test_faults_go_to_the_diloco_runs_only(bench) -> None:
    args = bench.parse_args(["--modes", "diloco,single,ddp", "--grid", f"faults.events={LOST}|[]", "--grid", "codec=int8"])
    (label, lost), (_, clean) = bench.variants(args.grid_axes)
    assert "lost" in label
    cfg = bench.build_config(args, "diloco", 0, lost)
    (event,) = bench.build_faults(args, cfg, lost).events
    assert (event.kind, event.prob, event.lost) == ("drop_push", 0.3, True) and cfg.codec.name == "int8"
    assert bench.build_faults(args, bench.build_config(args, "diloco", 0, clean), clean).events == ()
    for mode in ("single", "ddp"):
        assert bench.build_faults(args, bench.build_config(args, mode, 0, lost), lost) is None


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ('faults.events=[{"kind":"drop_push","prob":1.5}]', "faults.events[0].prob=1.5"),
        ('faults.events=[{"kind":"drop_push","prob":0.3,"lost":1}]', "faults.events[0].lost=1"),
        ("faults.colour=1", "faults.colour"),
    ],
)
def test_a_bad_fault_is_refused_naming_it(bench, override: str, fragment: str) -> None:
    args = bench.parse_args(["--modes", "diloco", "--set", override])
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        bench.build_faults(args, bench.build_config(args, "diloco", 0))


def test_main_refuses_a_bad_fault_before_any_run(bench, tmp_path: Path, capsys) -> None:
    assert bench.main(["--modes", "diloco", "--out", str(tmp_path / "out"), "--set", 'faults.events=[{"kind":"drop_push","prob":2}]']) == 2
    assert "faults.events[0].prob=2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
