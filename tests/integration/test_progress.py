"""Live progress (diloco/observe/progress.py): rates and ETAs on a fake clock, a bar drawn with
tqdm (carriage returns, log lines above it), plain lines without a terminal, a real site's
own progress (run_site against run_coordinator, in this process), and a real diloco-sim run
whose output is not a terminal: its plain progress lines are there, next to its one line per
committed round, and no carriage return or escape code is."""

from __future__ import annotations

import io
import json
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeClock, kill_group, sim_command

from diloco.app.config import run_config_from_dict
from diloco.app.coordinator import CoordinatorOptions, run_coordinator
from diloco.app.site import SiteOptions, run_site
from diloco.observe.progress import LiveProgress, ProgressConfig, ProgressTracker, SiteStep, format_eta, progress_config, read_positions

pytestmark = pytest.mark.timeout(150)

PLAIN = re.compile(r"progress: sites round (\d+)/(\d+)  (\d+)/(\d+) steps \((\d+)%\)  (?:[\d.]+|-) steps/s  round ETA (?:[\d:]+|\?)  run ETA (?:[\d:]+|\?)")


def test_the_tracker_counts_the_open_rounds_steps_across_sites_and_its_etas(fake_clock: FakeClock) -> None:
    t = ProgressTracker(rounds=4, sites=2, round_steps=10)
    s = t.update(fake_clock(), 0, {})
    assert (s.round, s.done, s.total, s.rate, s.round_eta_s, s.run_eta_s) == (0, 0, 20, None, None, None)  # nothing seen yet
    s = t.update(fake_clock(), 0, {"0": SiteStep(0, 2, 10), "1": SiteStep(0, 2, 10)})
    assert (s.done, s.total, s.rate) == (4, 20, None)
    fake_clock.t += 2
    s = t.update(fake_clock(), 0, {"0": SiteStep(0, 5, 10), "1": SiteStep(0, 3, 10)})  # 4 more steps in 2 s
    assert (s.done, s.rate) == (8, 2.0)
    assert s.round_eta_s == pytest.approx(12 / 2.0)
    assert s.run_eta_s == pytest.approx((80 - 8) / 2.0)
    assert s.describe() == "round 1/4  8/20 steps (40%)  2.0 steps/s  round ETA 0:06  run ETA 0:36"
    # The round shown is the furthest site's (metrics.jsonl's lines come a round late); a site
    # behind it (still syncing, or started again and not joined yet) has done none of it.
    fake_clock.t += 2
    s = t.update(fake_clock(), 1, {"0": SiteStep(2, 1, 10), "1": SiteStep(1, 10, 10)})
    assert (s.round, s.done, s.total) == (2, 1, 20)
    assert t.update(fake_clock(), 2, {"0": SiteStep(1, 3, 10)}).round == 2  # never before the rounds committed
    assert t.update(fake_clock(), 4, {}).describe() == "round 4/4 committed"
    # Flush rounds (fragments) have no steps.
    flush = ProgressTracker(rounds=3, sites=1, round_steps=5, train_rounds=2).update(0.0, 2, {"0": SiteStep(2, 0, 0)})
    assert (flush.done, flush.total) == (0, 0)
    assert [format_eta(x) for x in (None, 0, 59.6, 61, 3725)] == ["?", "0:00", "1:00", "1:01", "1:02:05"]


def test_plain_lines_at_most_every_s_and_only_when_something_moved(fake_clock: FakeClock) -> None:
    lines: list[str] = []
    live = LiveProgress(
        ProgressConfig(mode="lines", every_s=5), lines.append, ProgressTracker(rounds=2, sites=1, round_steps=4), label="site 7", clock=fake_clock
    )
    assert not live.bar_mode
    live.update(0, {})  # no site has stepped: nothing to say
    assert lines == []
    fake_clock.t += 1
    live.update(0, {"7": SiteStep(0, 1, 4)})  # the first: at once
    fake_clock.t += 1
    live.update(0, {"7": SiteStep(0, 2, 4)}, force=True)  # moved, but within every_s of the last line
    assert len(lines) == 1
    fake_clock.t += 5
    live.update(0, {"7": SiteStep(0, 2, 4)})  # every_s later: what moved since the last line
    fake_clock.t += 6
    live.update(0, {"7": SiteStep(0, 2, 4)})  # nothing moved since
    live.update(1, {"7": SiteStep(1, 1, 4)}, force=True)
    live.say("a log line")
    live.close()
    assert lines[0] == "progress: site 7 round 1/2  1/4 steps (25%)  - steps/s  round ETA ?  run ETA ?"
    assert lines[1].startswith("progress: site 7 round 1/2  2/4 steps (50%)  0.2 steps/s  round ETA 0:12  run ETA")
    assert lines[2].startswith("progress: site 7 round 2/2  1/4 steps (25%)  0.3 steps/s")
    assert lines[3:] == ["a log line"]
    off = LiveProgress(ProgressConfig(mode="off"), lines.append, ProgressTracker(rounds=2, sites=1, round_steps=4))
    off.update(0, {"7": SiteStep(0, 1, 4)})
    assert not off.enabled and len(lines) == 4


def test_a_bar_on_a_terminal_redraws_in_place_with_log_lines_above_it(fake_clock: FakeClock) -> None:
    out = io.StringIO()  # not a terminal: mode=bar draws anyway (auto would print lines)
    said: list[str] = []
    live = LiveProgress(ProgressConfig(mode="bar"), said.append, ProgressTracker(rounds=3, sites=2, round_steps=5), stream=out, clock=fake_clock)
    assert LiveProgress(ProgressConfig(), said.append, ProgressTracker(rounds=3, sites=2, round_steps=5), stream=io.StringIO()).lines_mode  # auto, no terminal
    with live:
        live.update(0, {"0": SiteStep(0, 1, 5), "1": SiteStep(0, 2, 5)})
        fake_clock.t += 1
        live.update(0, {"0": SiteStep(0, 3, 5), "1": SiteStep(0, 4, 5)})
        live.say("round   1/3 committed")
        fake_clock.t += 1
        live.update(1, {"0": SiteStep(1, 1, 5), "1": SiteStep(1, 0, 5)})
    drawn = out.getvalue()
    assert "\r" in drawn
    assert "sites round 1/3:" in drawn and "3/10 steps" in drawn and "7/10 steps" in drawn and "4.0 steps/s" in drawn
    assert "sites round 2/3:" in drawn and "1/10 steps" in drawn and "run ETA" in drawn
    assert said == ["round   1/3 committed"]  # through the log, the bar cleared around it
    assert not any("progress:" in line for line in said)  # no plain lines while a bar is drawn


def test_bad_progress_settings_are_named() -> None:
    assert progress_config({"mode": "lines", "every_s": 0}) == ProgressConfig(mode="lines", every_s=0)
    for values, says in (
        ({"mode": "fancy"}, "progress.mode='fancy'"),
        ({"every_s": -1}, "progress.every_s=-1"),
        ({"every_s": "x"}, "progress.every_s='x'"),
        ({"colour": 1}, "progress.colour"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            progress_config(values)


def test_positions_come_from_the_newest_incarnation_of_each_sites_progress_file(tmp_path: Path) -> None:
    d = tmp_path / "progress"
    d.mkdir()
    (d / "0.0.json").write_text(json.dumps({"tokens": 5, "round": 1, "step": 3, "steps": 4}))
    (d / "0.1.json").write_text(json.dumps({"tokens": 1, "round": 2, "step": 1, "steps": 4}))  # started again
    (d / "1.0.json").write_text(json.dumps({"tokens": 5}))  # an older site's file: no position
    (d / "2.0.json").write_text("{not json")  # being written
    assert read_positions(d) == {"0": SiteStep(2, 1, 4)}
    assert read_positions(tmp_path / "none") == {}


def test_a_site_shows_its_own_progress(tmp_path: Path) -> None:
    """diloco-site's progress: a real site (run_site) against a real coordinator, both here."""
    cfg = run_config_from_dict({"sites": 1, "rounds": 2, "eval_every": 2, "data": {"batch_size": 2}, "tensorboard": {"enabled": False}, "sync": {"every": 3}})
    port_file = tmp_path / "port.json"
    result: dict[str, Any] = {}

    def coordinator() -> None:
        try:
            run_coordinator(cfg, CoordinatorOptions(port=0, port_file=str(port_file), linger_s=30), tmp_path / "coordinator", log=lambda _m: None)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    runner = threading.Thread(target=coordinator, daemon=True)
    runner.start()
    lines: list[str] = []
    opts = SiteOptions(site_id="0", coordinator_port_file=str(port_file), connect_timeout_s=60, progress=ProgressConfig(mode="lines", every_s=0))
    try:
        run_site(cfg, opts, tmp_path / "site", log=lines.append)
    finally:
        runner.join(60)
    assert "error" not in result, result.get("error")
    shown = [line for line in lines if line.startswith("progress: site 0 ")]
    assert shown and shown[0].startswith("progress: site 0 round 1/2  1/3 steps (33%)"), lines
    assert any(line.startswith("progress: site 0 round 2/2  3/3 steps (100%)") for line in shown), shown
    assert any("round 0 done" in line for line in lines)  # the site's own log lines are still there
    record = json.loads((tmp_path / "site" / "progress" / "0.0.json").read_text())
    assert record == {"tokens": 6 * 2 * cfg.model.context, "round": 1, "step": 3, "steps": 3}


def test_diloco_sim_without_a_terminal_prints_plain_progress_lines(tmp_path: Path) -> None:
    """A real run (its stdout a pipe, as in CI): plain progress lines, the round lines, no bar."""
    run_dir = (tmp_path / "run").resolve()
    args = [
        "sites=2",
        "sync.every=3",
        "rounds=2",
        "data.batch_size=2",
        "eval_every=2",
        "sim.plots=false",
        "sim.credentials=false",
        "tensorboard.enabled=false",
        "metrics.port=null",
        "progress.every_s=0",
    ]
    popen = subprocess.Popen(
        [*sim_command(), *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = popen.communicate(timeout=120)
    finally:
        kill_group(popen)
    assert popen.returncode == 0, err
    plain = [m for m in map(PLAIN.search, out.splitlines()) if m]
    assert plain, out
    assert {int(m.group(2)) for m in plain} == {2} and all(int(m.group(4)) == 2 * 3 for m in plain)
    assert all(int(m.group(3)) <= int(m.group(4)) for m in plain)
    assert re.search(r"round   1/2  workers 2", out) and re.search(r"round   2/2  workers 2", out)  # one line per committed round, as before
    assert "progress: sites round 2/2 committed" in out
    assert "\r" not in out + err and "\x1b" not in out + err  # nothing drawn in place
    # The status page (status.port=0 by default): its address printed and written down.
    page = json.loads((run_dir / "status_page.json").read_text())
    assert page["url"] == f"http://127.0.0.1:{page['port']}/" and not page["tls"]
    assert f"status page: {page['url']}" in out
    assert json.loads((run_dir / "progress" / "0.0.json").read_text())["steps"] == 3
