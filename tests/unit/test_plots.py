"""A run directory read for plots (diloco.observe.rundata), the per-site timeline of rounds
(diloco.observe.timeline) and the plots themselves (diloco.observe.plots), on run directories
written with the run's own record types; the real runs are in tests/integration/test_report_cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from diloco.app import records
from diloco.app.records import MetricsLine, WorkerRecord
from diloco.observe.plots import DPI, plot_run, plot_runs
from diloco.observe.rundata import RunDirError, load_run
from diloco.observe.timeline import COORDINATOR, timeline

SITES = ["0", "1", "2"]
TOKENS = 1000  # per site and round
PARAMS_BYTES = 4000  # one fp32 payload


def _line(r: int, participants: list[str], *, eval_bpb: float | None = None, **what: Any) -> MetricsLine:
    fields: dict[str, Any] = dict(absent=[], evicted=[], late=[], merged=[], rejected=False, guard=None)
    fields.update(what)
    n = len(participants)
    return MetricsLine(
        round=r, participants=participants, tokens=n * TOKENS, inner_steps=n * 10, bytes_up=n * PARAMS_BYTES, bytes_down=n * PARAMS_BYTES,
        train_loss=4.0 - 0.5 * r, eval_loss=None if eval_bpb is None else eval_bpb * 0.693, eval_bpb=eval_bpb, eval_by=None if eval_bpb is None else "coordinator",
        update_norm=1.0, delta_norm=1.0, global_sha256=f"{r:064x}", wall_s=1.0, elapsed_s=float(r + 1), **fields,
    )  # fmt: skip


def _write_run(run_dir: Path, lines: list[MetricsLine], faults: list[dict[str, Any]], mode: str = "diloco") -> Path:
    run_dir.mkdir(parents=True)
    for line in lines:
        records.append_metrics(run_dir / "metrics.jsonl", line)
    with open(run_dir / "faults.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in faults)
    (run_dir / "config.json").write_text(json.dumps({"mode": mode, "sites": len(SITES), "codec": {"name": "fp32"}, "sync": {"every": 10}}))
    for s in SITES:
        w = WorkerRecord(
            site_id=s, shard=int(s), rounds=len(lines), tokens=0, inner_steps=0, bytes_up=0, bytes_down=0, global_sha256="", wall_s=1.0, peak_rss_mb=1.0,
            dropped_rounds=[2] if s == "2" else [],
        )  # fmt: skip
        records.write(run_dir / "workers" / f"{s}.json", w)
    return run_dir


@pytest.fixture
def eventful(tmp_path: Path) -> Path:
    """Five rounds of three sites with one of each thing the timeline shows."""
    merged = {"site": "2", "round": 1, "weight": 0.5, "tokens": TOKENS}
    refused = {"site": "1", "round": 4, "norm": 9.0, "reference": 1.0, "why": "exceeds 3 × the median"}
    lines = [
        _line(0, SITES),
        _line(1, ["0", "1"], absent=["2"]),
        _line(2, ["0", "1"], absent=["2"], merged=[merged], eval_bpb=3.0),
        _line(3, ["0", "2"], evicted=["1"], late=[{"site": "2", "round": 2}]),
        _line(4, SITES, refused=[refused], eval_bpb=2.5),
    ]
    faults = [
        {"event": 0, "kind": "kill_site", "process": "site 1", "site": 1, "round": 1, "phase": "inner", "restart_after_s": 1.0, "time": 1.0},
        {"event": 1, "kind": "slow_site", "process": "site 2", "site": 2, "round": 1, "factor": 5, "time": 2.0},
        {"event": 2, "kind": "kill_coordinator", "process": "coordinator", "round": 2, "phase": "between", "restart_after_s": 1.0, "time": 3.0},
        {"event": 3, "kind": "kill_site", "process": "site 0", "site": 0, "round": 3, "phase": "pull", "restart_after_s": 1.0, "time": 4.0},
    ]
    return _write_run(tmp_path / "run", lines, faults)


def test_the_timeline_names_what_happened_to_each_site_in_each_round(eventful: Path) -> None:
    t = timeline(load_run(eventful))
    assert t.rows == [*SITES, COORDINATOR] and t.rounds == [0, 1, 2, 3, 4]
    assert [t.states.get(("2", r)) for r in t.rounds] == ["pushed", "absent", "absent", "pushed", "pushed"]
    assert t.states[("1", 3)] == "evicted"
    events = {k: sorted(v) for k, v in t.events.items()}
    assert events == {
        ("1", 1): ["killed", "rejoined"],  # killed in the inner phase, started again, pushed that round
        ("2", 1): ["fault", "late"],  # slowed down; its push of round 1 merged into round 2
        ("2", 2): ["dropped"],  # its push of round 2 came too late and was refused
        (COORDINATOR, 2): ["killed"],
        ("0", 3): ["killed"],  # killed while pulling round 3: back with round 4
        ("0", 4): ["rejoined"],
        ("1", 4): ["refused", "rejoined"],  # back after its eviction; the norm bound refused its push
    }
    assert t.count("pushed") == 12 and t.count("rejoined") == 3


def _png(path: Path) -> np.ndarray:
    assert path.stat().st_size > 5_000, path
    return imread(path)


def test_a_run_s_plots_are_written_and_have_content(eventful: Path) -> None:
    written = plot_run(eventful)
    names = sorted(p.name for p in written)
    assert names == ["eval_vs_bytes.png", "eval_vs_tokens.png", "overview.png", "timeline.png", "train_loss_vs_tokens.png"]
    assert all(p.parent == eventful / "plots" for p in written)
    for p in written:
        image = _png(p)
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 600, (p.name, image.shape)
        inked = (image[..., :3] < 0.95).any(axis=2).mean()
        assert 0.01 < inked < 0.9, (p.name, inked)  # drawn on, not blank
    assert _png(eventful / "plots" / "eval_vs_tokens.png").shape[:2] == (round(4.4 * DPI), round(6.4 * DPI))
    # The timeline's cells are drawn in the state colours: pushed green and evicted orange.
    rgb = (_png(eventful / "plots" / "timeline.png")[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for colour in ((0x4C, 0xAF, 0x50), (0xFF, 0x98, 0x00)):
        assert (np.abs(rgb - colour).sum(axis=1) <= 3).sum() > 200, colour


def test_a_single_worker_run_without_bytes_still_plots(tmp_path: Path) -> None:
    lines = [_line(r, ["0"], eval_bpb=3.0 - r * 0.1) for r in range(3)]
    for line in lines:
        line.bytes_up = line.bytes_down = 0
    run_dir = _write_run(tmp_path / "single", lines, [], mode="single")
    run = load_run(run_dir)
    assert run.bytes_total == 0 and run.codec == "-" and run.final_eval == pytest.approx(2.8)
    assert len(plot_run(run_dir)) == 5
    assert _png(run_dir / "plots" / "eval_vs_bytes.png").shape[0] > 0


def test_several_runs_on_the_same_axes(eventful: Path, tmp_path: Path) -> None:
    other = _write_run(tmp_path / "other", [_line(r, SITES, eval_bpb=3.2 - 0.2 * r) for r in range(4)], [])
    runs = [load_run(eventful), load_run(other)]
    written = plot_runs(runs, tmp_path / "report")
    assert sorted(p.name for p in written) == ["eval_vs_bytes.png", "eval_vs_tokens.png", "overview.png", "train_loss_vs_tokens.png"]
    assert _png(tmp_path / "report" / "overview.png").shape[1] > 2 * _png(tmp_path / "report" / "eval_vs_tokens.png").shape[1]
    with pytest.raises(ValueError, match="1 label"):
        plot_runs(runs, tmp_path / "bad", labels=["only one"])
    finals = runs[1].finals()
    assert finals["tokens"] == 4 * 3 * TOKENS and finals["bytes"] == 4 * 3 * 2 * PARAMS_BYTES and finals["final_eval_bpb"] == pytest.approx(2.6)


def test_what_is_not_a_run_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no such directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(RunDirError, match="file.txt: not a directory"):
        load_run(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"empty: not a run directory"):
        load_run(tmp_path / "empty")
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "config.json").write_text("{}")
    with pytest.raises(RunDirError, match="started: no metrics.jsonl"):
        load_run(tmp_path / "started")
    (tmp_path / "started" / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="metrics.jsonl holds no committed round"):
        load_run(tmp_path / "started")
    (tmp_path / "started" / "metrics.jsonl").write_text('{"round": 0}\nnot json\n{"round": 1}\n')
    with pytest.raises(RunDirError, match="metrics.jsonl line 2: not valid JSON"):
        load_run(tmp_path / "started")


def test_a_plot_that_fails_is_logged_and_the_run_stands(tmp_path: Path) -> None:
    from diloco.sim.launcher import _plot

    said: list[str] = []
    (tmp_path / "summary.json").write_text("{}")  # a run whose metrics.jsonl is gone
    _plot(tmp_path, said.append)
    assert len(said) == 1 and "plots not made" in said[0] and "no metrics.jsonl" in said[0]
    assert (tmp_path / "summary.json").read_text() == "{}"
