"""Watching a simulated run's processes until they are done: fault events as they fire, a
planned kill's process started again, a crash or the deadline a SimError, and the committed
rounds (and the live progress) shown as they land."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco.app.config import RunConfig
from diloco.io import read_jsonl
from diloco.observe.progress import OFF, LiveProgress, ProgressConfig, ProgressTracker, read_positions
from diloco.run_dir import RunDir
from diloco.sim.faults import read_fired
from diloco.sim.processes import Proc, SimError, failure, fired_events, is_torchrun, start_process


def live_progress(cfg: RunConfig, live: ProgressConfig | None, say: Callable[[str], None]) -> LiveProgress:
    """The run's progress bar (or plain lines): the open round's inner steps across the sites
    (mode=diloco: the baselines' ranks write no progress files)."""
    schedule = cfg.schedule
    tracker = ProgressTracker(
        rounds=cfg.sync_rounds, sites=cfg.sites, round_steps=schedule.round_steps, train_rounds=schedule.train_rounds, early=schedule.early
    )
    return LiveProgress(live if live is not None and cfg.mode == "diloco" else OFF, say, tracker, label="sites")


def supervise(procs: list[Proc], run_dir: Path, cfg: RunConfig, deadline: float, say: Callable[[str], None], live: LiveProgress | None = None) -> None:
    shown = 0
    handled = 0  # fired fault events already read
    kills: list[dict[str, Any]] = []  # planned kills whose process has not been seen dead yet
    metrics = RunDir(run_dir).metrics
    while True:
        fired = read_fired(run_dir)
        for event in fired[handled:]:
            say(f"fault: {describe_fired(event)}")
        kills += [e for e in fired[handled:] if "restart_after_s" in e]
        handled = len(fired)
        for p in procs:
            code = p.popen.poll()
            if p.service and code is not None:
                raise SimError(failure(p))
            if code in (None, 0) or p.restart_at is not None or p.gone:
                continue
            planned = next((e for e in kills if e["process"] == p.name), None)
            # A torchrun group whose rank was SIGKILLed exits with an error code of its own.
            killed = code == -signal.SIGKILL or (is_torchrun(p.cmd) and code > 0)
            if not killed or planned is None:
                raise SimError(failure(p))
            kills.remove(planned)
            if planned["restart_after_s"] < 0:
                p.gone = True
            else:
                p.restart_at = time.monotonic() + planned["restart_after_s"]
        for i, p in enumerate(procs):
            if p.restart_at is not None and time.monotonic() >= p.restart_at:
                p.log_file.close()
                procs[i] = start_process(p.name, p.cmd, run_dir, p.incarnation + 1, fired_events(run_dir), nice=p.nice, zygote=p.zygote)
                say(f"started {p.name} again (incarnation {p.incarnation + 1})")
        lines = read_jsonl(metrics) if metrics.exists() else []
        for line in lines[shown:]:
            say(progress_line(line, cfg))
        shown = len(lines)
        if live is not None and live.enabled:
            live.update(shown, read_positions(RunDir(run_dir).progress_dir))  # the open round's inner steps
        done = [p.service or p.gone or (p.restart_at is None and p.popen.poll() == 0) for p in procs]
        if all(done):
            return
        if cfg.mode == "diloco" and all(d for p, d in zip(procs, done) if p.name != "coordinator"):
            # No site is left to come back (killed for good, or left): the coordinator need not
            # wait its linger_s for them after the last round.
            RunDir(run_dir).sites_done.touch()  # the coordinator stops lingering
        if time.monotonic() > deadline:
            running = ", ".join(p.name for p in procs if p.popen.poll() is None)
            raise SimError(f"the run did not finish before sim.timeout_s; still running: {running}")
        time.sleep(0.2)


def describe_fired(e: dict[str, Any]) -> str:
    details = ", ".join(f"{k}={e[k]}" for k in ("round", "phase", "seconds", "factor", "restart_after_s") if k in e)
    return f"{e['kind']} ({e['process']}; {details})"


def progress_line(m: dict[str, Any], cfg: RunConfig) -> str:
    kind, key = ("eval_bpb", "eval_bpb") if cfg.data.format == "bytes" else ("eval_loss", "eval_loss")
    ev = f"{m[key]:.4f}" if m.get(key) is not None else "  -   "
    loss = f"{m['train_loss']:.4f}" if m.get("train_loss") is not None else "-"
    return (
        f"round {m['round'] + 1:>3}/{cfg.sync_rounds}  workers {len(m['participants'])}  train_loss {loss}  "
        f"{kind} {ev}  up {m['bytes_up'] / 1e6:8.2f} MB  down {(m['bytes_down'] or 0) / 1e6:8.2f} MB  {m['elapsed_s']:7.1f} s"
    )
