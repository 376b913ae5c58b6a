"""Starts the processes of a simulated run, shows progress, and writes summary.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diloco.app.config import ConfigError, RunConfig, run_config_from_dict, run_config_to_dict
from diloco.app.preset import apply_preset
from diloco.data import load_corpus
from diloco.io import write_json_atomic
from diloco.observe.logs import log_at
from diloco.observe.progress import ProgressConfig
from diloco.observe.status_page import access_hint
from diloco.run_dir import RunDir
from diloco.security.store import write_run_credentials
from diloco.sim.faults import FaultsConfig, faults_to_dict
from diloco.sim.links import WanPlan
from diloco.sim.processes import (
    CHILD,
    SITE_NICE,
    Proc,
    SimError,
    SimStopped,
    child_env,
    describe_wan,
    fired_events,
    next_incarnation,
    start_process,
    start_wan,
    stop_all,
    wait_port,
)
from diloco.sim.sections import check_before_start, sim_faults
from diloco.sim.summary import summarize
from diloco.sim.supervise import live_progress, supervise
from diloco.sim.zygote import Zygote
from diloco.site.device import resolve_device
from diloco.sync import Preset

__all__ = ["SimError", "SimStopped", "run_simulation"]


def run_simulation(
    cfg: RunConfig,
    run_dir: Path,
    *,
    timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = print,
    resume: bool = False,
    faults: FaultsConfig | Mapping[str, Any] | None = None,
    credentials: bool = True,
    wan: WanPlan | None = None,
    plots: bool = True,
    metrics_port: int | None = None,
    status_port: int | None = None,
    live: ProgressConfig | None = None,
    fork: bool = True,
    coordinator_shards: int = 1,
) -> dict[str, Any]:
    """Runs ``cfg`` as separate OS processes and returns the summary (also in run_dir/summary.json).

    ``status_port``: the coordinator serves its read-only status page there (0: any free port),
    with the run's security settings, and writes its address to run_dir/status_page.json; None:
    no page. ``live``: a progress bar (or plain lines) of the open round's inner steps across
    the sites (mode=diloco), shown with ``progress``'s lines; None: none
    (docs/observability.md).

    ``metrics_port``: the coordinator serves Prometheus /metrics there (0: any free port) and
    each site on a free port of its own; each writes its address to run_dir/prometheus/
    <process>.json (docs/observability.md). None: no /metrics.

    ``faults``: what to inject into the processes (a FaultsConfig, or its plain data).

    ``credentials``: unless ``cfg.security.dir`` names the run's credentials, make them
    (diloco-certs' layout, in run_dir/credentials), so every channel runs as a real run's
    would (TLS, and security.auth's client certificates and tokens); False: plaintext.

    ``wan``: the emulated links (diloco.sim.links.wan_plan): every site then reaches the
    coordinator through its own port of a WAN emulator process, which shapes the real byte
    streams (bandwidth, RTT, jitter); None: loopback as it is.

    ``plots``: draw the run's plots into run_dir/plots at the end (diloco.observe.plots); a
    plot that fails is logged and changes nothing else.

    ``fork``: start the Python processes (not torchrun's groups) by forking them from a warm
    zygote process that imported torch and this package once (diloco.sim.zygote), when the
    sites train on the CPU; False (and on a GPU): each a fresh interpreter (~3.5 s of CPU more
    per process).

    ``resume``: go on with the (stopped or crashed) run in ``run_dir``: its config must be
    ``cfg``; the coordinator resumes from its checkpoint, every site from its own, and the
    metrics, progress and fault records are kept. Otherwise whatever a previous run left in
    ``run_dir`` is removed first.
    Raises SimError if any process exits non-zero (naming it and its log) or on timeout; every
    process started is stopped before this returns or raises.
    """
    say = progress or (lambda _msg: None)
    run_dir = run_dir.resolve()
    for s in range(cfg.sites if cfg.mode == "diloco" else 0):
        if cfg.layout_of(s).ranks is None:
            raise ConfigError(
                "parallel.dp_shard=-1 takes the ranks torchrun starts a site with, and diloco-sim starts each site itself: give parallel.dp_shard a number"
            )
    # Its imports (seconds of CPU) run while this process checks the data and the config.
    zygote = Zygote(run_dir, child_env()) if fork and _on_cpu(cfg) else None
    try:
        return _run(cfg, run_dir, say, zygote, timeout_s, resume, faults, credentials, wan, plots, metrics_port, status_port, live, coordinator_shards)
    finally:
        if zygote is not None:
            zygote.close()


def _on_cpu(cfg: RunConfig) -> bool:
    """Whether the sites train on the CPU. Runs on a GPU are not forked: a zygote whose imports
    touched CUDA (torch's availability check) would leave its children unable to use it."""
    try:
        return resolve_device(cfg.device).type == "cpu"
    except ValueError:  # DeviceError: refused by check_before_start, naming the device
        return False


def _run(
    cfg: RunConfig, run_dir: Path, say: Callable[[str], None], zygote: Zygote | None, timeout_s: float, resume: bool, faults: FaultsConfig | Mapping[str, Any] | None,
    credentials: bool, wan: WanPlan | None, plots: bool, metrics_port: int | None, status_port: int | None, live: ProgressConfig | None,
    coordinator_shards: int = 1,
) -> dict[str, Any]:  # fmt: skip
    rd = RunDir(run_dir)
    cfg = _with_preset(cfg, rd, wan, resume, say)
    # Fail on bad data here, before any process starts (DataError names the path).
    load_corpus(cfg.data, cfg.model.context, num_shards=cfg.workers)
    check_before_start(cfg)
    faults = faults if isinstance(faults, FaultsConfig) else sim_faults(faults, cfg)
    if credentials and cfg.mode == "diloco" and cfg.security.dir is None:
        cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, dir=str(rd.credentials_dir)))
    config_path = _prepare_run_dir(cfg, run_dir, faults, resume)
    if credentials and cfg.security.dir == str(rd.credentials_dir) and not (resume and (rd.credentials_dir / "ca.pem").exists()):
        write_run_credentials(rd.credentials_dir, [str(s) for s in range(cfg.sites)], hosts=["localhost", "127.0.0.1"], days=30, force=True)
    procs: list[Proc] = []
    start = time.monotonic()
    # SIGTERM must unwind through the finally below, which stops every child.
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if threading.current_thread() is threading.main_thread() else None
    common = ["--config", str(config_path), "--run-dir", str(run_dir)]
    shown = live_progress(cfg, live, say)
    try:
        _start_processes(cfg, run_dir, common, procs, start, shown.say, wan, metrics_port, status_port, zygote, coordinator_shards)
        supervise(procs, run_dir, cfg, deadline=start + timeout_s, say=shown.say, live=shown)
    finally:
        shown.close()
        stop_all(procs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary = summarize(cfg, run_dir, wall_s=time.monotonic() - start, wan=wan)
    write_json_atomic(rd.summary, summary)
    if plots:
        _plot(run_dir, say)
    return summary


def _with_preset(cfg: RunConfig, rd: RunDir, wan: WanPlan | None, resume: bool, say: Callable[[str], None]) -> RunConfig:
    """The run with what ``sync.preset`` chooses (diloco.app.preset) for its link: the slowest
    emulated site's; a resumed run keeps what the preset chose when it started (config.json)."""
    if cfg.sync.preset == Preset.NONE or cfg.mode != "diloco":
        return cfg
    if resume and rd.config.exists():
        saved = run_config_from_dict(json.loads(rd.config.read_text()))
        return dataclasses.replace(cfg, sync=saved.sync, codec=saved.codec, codec_down=saved.codec_down)
    link = None
    if wan is not None and wan.sites:
        rates = [min(x for x in (s.up_mbit, s.down_mbit) if x is not None) for s in wan.sites.values() if s.up_mbit is not None or s.down_mbit is not None]
        link = (min(rates), max(s.rtt_ms for s in wan.sites.values())) if rates else None
    try:
        return apply_preset(cfg, link=link, shared_cores=True, log=say)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _plot(run_dir: Path, say: Callable[[str], None]) -> None:
    """The run's plots; whatever goes wrong is logged, never raised: the run is done and written."""
    try:
        from diloco.observe.plots import plot_run  # matplotlib: only now

        plot_run(run_dir)
        say(f"plots: {RunDir(run_dir).plots_dir}")
    except Exception as e:  # noqa: BLE001 - a plot must never fail or lose a finished run
        log_at(say, logging.WARNING, f"plots not made ({type(e).__name__}: {e}); the run's results are complete")


def _prepare_run_dir(cfg: RunConfig, run_dir: Path, faults: FaultsConfig, resume: bool) -> Path:
    """Clears what a previous run left (or, resuming, checks it is this run's) and writes the
    config and fault files every process reads; returns the config file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rd = RunDir(run_dir)
    for stale in rd.stale_files:
        stale.unlink(missing_ok=True)
    shutil.rmtree(rd.prometheus_dir, ignore_errors=True)  # the addresses of processes gone
    if resume:
        _check_resumable(cfg, run_dir)
    else:
        for stale in (rd.metrics, rd.faults_fired):
            stale.unlink(missing_ok=True)
        for stale_dir in rd.stale_dirs:
            shutil.rmtree(stale_dir, ignore_errors=True)
    write_json_atomic(rd.config, run_config_to_dict(cfg))
    write_json_atomic(rd.faults, faults_to_dict(faults))
    return rd.config


def _start_processes(
    cfg: RunConfig, run_dir: Path, common: list[str], procs: list[Proc], start: float, say: Callable[[str], None], wan: WanPlan | None = None,
    metrics_port: int | None = None, status_port: int | None = None, zygote: Zygote | None = None, coordinator_shards: int = 1,
) -> None:  # fmt: skip
    """Starts the run's processes, appending each to ``procs`` as it starts (so that the caller
    stops every one of them, whatever fails here)."""
    rd = RunDir(run_dir)

    def metrics(process: str, port: int) -> list[str]:
        return [] if metrics_port is None else ["--metrics-port", str(port), "--metrics-file", str(rd.prometheus(process))]

    base = CHILD
    if cfg.mode == "diloco":
        port_file = rd.coordinator_port
        site_port_files = {str(s): port_file for s in range(cfg.sites)}
        if wan is not None:
            site_port_files = start_wan(wan, run_dir, port_file, procs, deadline=start + 60)
            say(f"WAN emulation: {describe_wan(wan)}")
        # Checkpoints every round: a coordinator killed by a fault resumes from them.
        rd.sites_done.unlink(missing_ok=True)  # a resumed run's sites are about to start again
        coordinator = base + [
            "coordinator", *common, "--port-file", str(port_file), "--checkpoint-dir", str(rd.coordinator_checkpoints),
            "--sites-done-file", str(rd.sites_done), *metrics("coordinator", metrics_port or 0), "--shards", str(coordinator_shards),
        ]  # fmt: skip
        if status_port is not None:
            coordinator += ["--status-port", str(status_port), "--status-file", str(rd.status_page)]
        procs.append(start_process("coordinator", coordinator, run_dir, next_incarnation(run_dir, "coordinator"), fired_events(run_dir), zygote=zygote))
        # The sites start at the same time (importing torch, building the model and the
        # data take most of a start) and connect once the coordinator's port file exists.
        for s in range(cfg.sites):
            ranks = cfg.layout_of(s).ranks
            # A site of several ranks is a torchrun group, as in a real run.
            launcher = (
                base if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "diloco.sim.child"]
            )
            site = launcher + [
                "site",
                *common,
                "--site-id",
                str(s),
                "--coordinator-port-file",
                str(site_port_files[str(s)]),
                "--checkpoint-dir",
                str(rd.site_checkpoints(s)),
                *metrics(f"site-{s}", 0),
            ]
            # Behind the emulator, sites yield the cores to it: its deliveries (the links' RTT)
            # must not wait for a training step (docs/wan.md).
            procs.append(
                start_process(
                    f"site {s}", site, run_dir, next_incarnation(run_dir, f"site {s}"), fired_events(run_dir), nice=SITE_NICE if wan else 0, zygote=zygote
                )
            )
        coordinator_proc = next(p for p in procs if p.name == "coordinator")
        port = wait_port(port_file, coordinator_proc, deadline=start + 120)
        coordinator_proc.cmd += ["--port", str(port)]  # a restarted coordinator listens where the sites call
        say(f"coordinator on 127.0.0.1:{port}; {cfg.sites} site(s) started")
        if metrics_port is not None:
            # Written before the port file; a restarted coordinator serves /metrics where it did.
            where = json.loads(rd.prometheus("coordinator").read_text())
            coordinator_proc.cmd += ["--metrics-port", str(where["port"])]
            say(f"Prometheus metrics: coordinator {where['url']}; each site's address in {rd.prometheus_dir}/site-<id>.json")
        if status_port is not None:
            # Written before the port file; a restarted coordinator serves the page where it did.
            page = json.loads(rd.status_page.read_text())
            coordinator_proc.cmd += ["--status-port", str(page["port"])]
            say(f"status page: {page['url']}{access_hint(cfg.security)} (address in {rd.status_page})")
    else:
        init_file = rd.pg_init
        init_file.unlink(missing_ok=True)
        for rank in range(cfg.workers):
            args = ["worker", *common, "--rank", str(rank), "--world-size", str(cfg.workers), "--init-file", str(init_file)]
            procs.append(start_process(f"rank {rank}", base + args, run_dir, zygote=zygote))


def _check_resumable(cfg: RunConfig, run_dir: Path) -> None:
    if cfg.mode != "diloco":
        raise SimError(f"only mode=diloco runs can be resumed (mode={cfg.mode} keeps no checkpoints)")
    config_path = RunDir(run_dir).config
    if not config_path.exists() or not RunDir(run_dir).checkpoints_dir.is_dir():
        raise SimError(f"nothing to resume in {run_dir}: no config.json or checkpoints/ (start it without resume)")
    saved = json.loads(config_path.read_text())
    if saved != run_config_to_dict(cfg):
        diff = sorted(k for k in set(saved) | set(run_config_to_dict(cfg)) if saved.get(k) != run_config_to_dict(cfg).get(k))
        raise SimError(f"cannot resume {run_dir} with another config (differs in: {', '.join(diff)})")


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SimStopped(f"stopped by signal {signum}")
