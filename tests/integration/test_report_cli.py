"""diloco-sim's plots and diloco-report, on two small real runs (DiLoCo and its ddp baseline):
the plots are made, several runs go on the same axes, the table holds their final figures,
and what is not a run is refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, Run, run_ok
from matplotlib.image import imread

from diloco.observe.logs import parse_line

TINY = ["sites=2", "sync.every=2", "rounds=2", "data.batch_size=2", "eval_every=1", "sim.timeout_s=120"]
PLOTS = ["eval_vs_bytes.png", "eval_vs_tokens.png", "overview.png", "timeline.png", "train_loss_vs_tokens.png"]


def report_command() -> list[str]:
    for candidate in (Path(sys.executable).parent / "diloco-report", ROOT / ".venv" / "bin" / "diloco-report"):
        if candidate.exists():
            return [str(candidate)]
    found = shutil.which("diloco-report")
    return [found] if found else [sys.executable, "-m", "diloco.cli.report"]


def report(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*report_command(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("runs")
    return {"diloco": run_ok(base / "diloco", "mode=diloco", *TINY, plots=True), "ddp": run_ok(base / "ddp", "mode=ddp", *TINY, plots=True)}


@pytest.mark.parametrize("mode", ["diloco", "ddp"])
def test_every_simulation_ends_with_its_plots(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    plots = run.run_dir / "plots"
    assert sorted(p.name for p in plots.iterdir()) == PLOTS, run.describe()
    for name in PLOTS:
        image = imread(plots / name)
        assert (plots / name).stat().st_size > 5_000 and image.shape[0] >= 300 and image.shape[1] >= 600, (name, image.shape)
    assert f"plots: {plots}" in run.stdout


def test_the_runs_log_time_process_level_message_lines(runs: dict[str, Run]) -> None:
    """Text logs (the default): every line of every process's log file, and diloco-sim's own."""
    expected = {"coordinator.log": "coordinator", "site0.log": "site 0", "site1.log": "site 1", "rank0.log": "rank 0", "rank1.log": "rank 1"}
    for run in runs.values():
        for path in (run.run_dir / "logs").glob("*.log"):
            lines = path.read_text().splitlines()
            parsed = [parse_line(line) for line in lines]
            assert all(p is not None and p["process"] == expected[path.name] and p["level"] == "INFO" for p in parsed), lines
        own = [p for p in map(parse_line, run.stdout.splitlines()) if p is not None]
        assert {p["process"] for p in own} == {"diloco-sim"} and any(p["message"].startswith("results: ") for p in own)
    coordinator = [parse_line(line) for line in (runs["diloco"].run_dir / "logs" / "coordinator.log").read_text().splitlines()]
    assert any(p and p["message"].startswith("round 1 committed: sites=0,1") for p in coordinator)
    rank0 = [parse_line(line) for line in (runs["ddp"].run_dir / "logs" / "rank0.log").read_text().splitlines()]
    assert any(p and p["message"].startswith("ddp round 1 done: train_loss=") for p in rank0)


def test_report_draws_runs_together_and_tabulates_their_final_figures(runs: dict[str, Run], tmp_path: Path) -> None:
    d, ddp = runs["diloco"], runs["ddp"]
    done = report(d.run_dir, ddp.run_dir, "--out", tmp_path / "cmp", "--figure", tmp_path / "fig" / "both.png", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["mode"] for r in rows] == ["diloco", "ddp"] and [r["path"] for r in rows] == [str(d.run_dir), str(ddp.run_dir)]
    for row, run in zip(rows, (d, ddp)):
        s = run.summary
        assert row["final_eval"] == s["final_eval_bpb"] and row["eval_metric"] == "eval_bpb"
        assert (row["tokens"], row["bytes"], row["wall_s"], row["sites"], row["H"]) == (s["tokens"], s["bytes_up"] + s["bytes_down"], s["wall_s"], 2, 2)
    assert rows[0]["codec"] == "fp32" and rows[1]["codec"] == "-"
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == sorted([*[p for p in PLOTS if p != "timeline.png"], "table.md"])
    overview = imread(tmp_path / "fig" / "both.png")
    assert overview.shape[1] >= 1500 and (tmp_path / "fig" / "both.png").read_bytes() == (tmp_path / "cmp" / "overview.png").read_bytes()
    # The text table: a row per run with its final figures; the plots go to ./report by default.
    text = report(d.run_dir, ddp.run_dir, "--label", "DiLoCo", "--label", "DDP", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("| run") and "final eval_bpb" in lines[0] and "wall_s" in lines[0]
    assert lines[2].startswith("| DiLoCo ") and f"{d.summary['final_eval_bpb']:.4f}" in lines[2] and "| diloco |" in lines[2]
    assert lines[3].startswith("| DDP ") and f"{ddp.summary['final_eval_bpb']:.4f}" in lines[3] and "| ddp " in lines[3]
    assert (tmp_path / "report" / "table.md").read_text().splitlines() == lines[:4]


def test_report_refuses_what_is_not_a_run_naming_it(runs: dict[str, Run], tmp_path: Path) -> None:
    good = runs["diloco"].run_dir
    (tmp_path / "nothing").mkdir()
    no_metrics = tmp_path / "no_metrics"
    no_metrics.mkdir()
    shutil.copy(good / "config.json", no_metrics / "config.json")
    cases = {
        tmp_path / "missing": "no such directory",
        tmp_path / "nothing": "not a run directory",
        no_metrics: "no metrics.jsonl",
        good / "summary.json": "not a directory",
    }
    for bad, why in cases.items():
        done = report(good, bad, "--out", tmp_path / "out", cwd=tmp_path)
        assert done.returncode == 2 and f"error: {bad}: {why}" in done.stderr, (bad, done.stderr)
        assert done.stdout == "" and not (tmp_path / "out").exists()
    mismatch = report(good, "--label", "a", "--label", "b", cwd=tmp_path)
    assert mismatch.returncode == 2 and "--label given 2 time(s) for 1 run(s)" in mismatch.stderr
