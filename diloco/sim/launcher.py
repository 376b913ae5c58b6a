"""Starts the processes of a simulated run, shows progress, and writes summary.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from diloco.app.config import ConfigError, RunConfig, run_config_to_dict
from diloco.wire.fingerprint import fingerprint, mismatches
from diloco.coordinator.init_file import load_init_file
from diloco.data import load_corpus
from diloco.model import build_model, is_builtin
from diloco.outer.fragments import split_fragments
from diloco.site.device import resolve_device
from diloco.sim.faults import FAULTS_FILE, FIRED_FILE, FaultsConfig, faults_to_dict, read_fired
from diloco.app import records
from diloco.app.records import GlobalRecord, MetricsLine, ProgressRecord, Summary, WorkerRecord
from diloco.io import read_jsonl, write_json_atomic
from diloco.observe.logs import log_at
from diloco.observe.config import check_port
from diloco.observe.prom import check_port_free
from diloco.observe.progress import OFF, LiveProgress, ProgressConfig, ProgressTracker, read_positions
from diloco.observe.status_page import access_hint
from diloco.observe.rundata import PLOTS_DIR
from diloco.observe.tensorboard import TB_DIR
from diloco.security.store import write_run_credentials
from diloco.sim.links import LinkSpec, WanPlan, wan_plan
from diloco.sim.zygote import Forked, Zygote, die_with_parent


CREDENTIALS_DIR = "credentials"  # the run's credentials a simulation makes (diloco-certs' layout)


class SimError(RuntimeError):
    """A simulated process failed or the run timed out; the message names the process."""


class SimStopped(SimError):
    """The simulator itself got SIGTERM (its children were stopped): callers running several
    simulations should stop too, not go on to the next one."""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes] | Forked
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    cmd: list[str] = field(default_factory=list)  # without --incarnation / --skip-faults
    incarnation: int = 0
    restart_at: float | None = None  # a planned kill: start it again then (monotonic)
    gone: bool = False  # killed for good (restart_after_s < 0)
    service: bool = False  # runs until stopped (the WAN emulator): not waited for, stopped last with SIGTERM
    nice: int = 0  # added niceness (sites behind the WAN emulator, so its deliveries are on time)
    zygote: Zygote | None = field(default=None, repr=False)  # what it was forked from (and is again when restarted)


def sim_faults(d: Mapping[str, Any] | None, cfg: RunConfig) -> FaultsConfig:
    """The ``faults`` section (plain data) of a simulation of ``cfg``; ConfigError naming the
    event and key that cannot work."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"events"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('faults.' + k for k in unknown)}; known: events")
    try:
        faults = FaultsConfig(events=tuple(d.get("events") or ()))
        faults.check_against(cfg.sites, cfg.sync_rounds)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return faults


def sim_wan(wan: Mapping[str, Any] | None, site_wan: Any, cfg: RunConfig) -> WanPlan | None:
    """The ``wan`` and ``site_wan`` sections of a simulation of ``cfg``; ConfigError naming the field."""
    try:
        plan = wan_plan(wan, site_wan, cfg.sites)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if plan is not None and cfg.mode != "diloco":
        raise ConfigError(f"wan: emulated links sit between the sites and the coordinator; mode={cfg.mode} has no coordinator")
    return plan


PROM_DIR = "prometheus"  # <run dir>/prometheus/<process>.json: where each process serves /metrics


def sim_metrics(d: Mapping[str, Any] | None, cfg: RunConfig) -> int | None:
    """The ``metrics`` section of a simulation: the coordinator's /metrics port (0: any free
    one; None: no process serves /metrics; the baselines have none). ConfigError naming the
    field; a port something listens on already is refused here, before any process starts."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"port"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('metrics.' + k for k in unknown)}; known: port")
    port = d.get("port")
    try:
        check_port(port, "metrics.port")
        if port:
            check_port_free("127.0.0.1", port)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return port if cfg.mode == "diloco" else None


SITES_DONE_FILE = "sites_done"  # <run dir>/sites_done: touched once every site process has exited (the coordinator stops lingering)
STATUS_FILE = "status_page.json"  # <run dir>/status_page.json: where the coordinator serves its status page


def sim_status(d: Mapping[str, Any] | None, cfg: RunConfig) -> int | None:
    """The ``status`` section of a simulation: the port of the coordinator's status page (0: any
    free one; None: none; the baselines have none). ConfigError naming the field; a port in
    use is refused here, before any process starts."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"port"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('status.' + k for k in unknown)}; known: port")
    port = d.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"status.port={port!r}: must be null (no status page), 0 (any free port) or a port in 1..65535")
    try:
        if port:
            check_port_free("127.0.0.1", port, field="status.port")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return port if cfg.mode == "diloco" else None


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
    # Its imports (seconds of CPU) run while this process checks the data and the config.
    zygote = Zygote(run_dir, _child_env()) if fork and _on_cpu(cfg) else None
    try:
        return _run(cfg, run_dir, say, zygote, timeout_s, resume, faults, credentials, wan, plots, metrics_port, status_port, live)
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
) -> dict[str, Any]:  # fmt: skip
    # Fail on bad data here, before any process starts (DataError names the path).
    load_corpus(cfg.data, cfg.model.context, num_shards=cfg.workers)
    check_before_start(cfg)
    faults = faults if isinstance(faults, FaultsConfig) else sim_faults(faults, cfg)
    if credentials and cfg.mode == "diloco" and cfg.security.dir is None:
        cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, dir=str(run_dir / CREDENTIALS_DIR)))
    config_path = _prepare_run_dir(cfg, run_dir, faults, resume)
    if credentials and cfg.security.dir == str(run_dir / CREDENTIALS_DIR) and not (resume and (run_dir / CREDENTIALS_DIR / "ca.pem").exists()):
        write_run_credentials(run_dir / CREDENTIALS_DIR, [str(s) for s in range(cfg.sites)], hosts=["localhost", "127.0.0.1"], days=30, force=True)
    procs: list[_Proc] = []
    start = time.monotonic()
    # SIGTERM must unwind through the finally below, which stops every child.
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if threading.current_thread() is threading.main_thread() else None
    common = ["--config", str(config_path), "--run-dir", str(run_dir)]
    shown = _live_progress(cfg, live, say)
    try:
        _start_processes(cfg, run_dir, common, procs, start, shown.say, wan, metrics_port, status_port, zygote)
        _supervise(procs, run_dir, cfg, deadline=start + timeout_s, say=shown.say, live=shown)
    finally:
        shown.close()
        _stop_all(procs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary = _summarize(cfg, run_dir, wall_s=time.monotonic() - start, wan=wan)
    write_json_atomic(run_dir / "summary.json", summary)
    if plots:
        _plot(run_dir, say)
    return summary


def _plot(run_dir: Path, say: Callable[[str], None]) -> None:
    """The run's plots; whatever goes wrong is logged, never raised: the run is done and written."""
    try:
        from diloco.observe.plots import plot_run  # matplotlib: only now

        plot_run(run_dir)
        say(f"plots: {run_dir / PLOTS_DIR}")
    except Exception as e:  # noqa: BLE001 - a plot must never fail or lose a finished run
        log_at(say, logging.WARNING, f"plots not made ({type(e).__name__}: {e}); the run's results are complete")


def _prepare_run_dir(cfg: RunConfig, run_dir: Path, faults: FaultsConfig, resume: bool) -> Path:
    """Clears what a previous run left (or, resuming, checks it is this run's) and writes the
    config and fault files every process reads; returns the config file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.json"
    for stale in ("global.json", "summary.json", "coordinator.port.json", STATUS_FILE, PIDS_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(run_dir / PROM_DIR, ignore_errors=True)  # the addresses of processes gone
    if resume:
        _check_resumable(cfg, run_dir)
    else:
        for stale in ("metrics.jsonl", FIRED_FILE):
            (run_dir / stale).unlink(missing_ok=True)
        for stale_dir in ("checkpoints", "progress", "workers", "logs", PLOTS_DIR, TB_DIR, CREDENTIALS_DIR):
            shutil.rmtree(run_dir / stale_dir, ignore_errors=True)
    write_json_atomic(config_path, run_config_to_dict(cfg))
    write_json_atomic(run_dir / FAULTS_FILE, faults_to_dict(faults))
    return config_path


def _start_processes(
    cfg: RunConfig, run_dir: Path, common: list[str], procs: list[_Proc], start: float, say: Callable[[str], None], wan: WanPlan | None = None,
    metrics_port: int | None = None, status_port: int | None = None, zygote: Zygote | None = None,
) -> None:  # fmt: skip
    """Starts the run's processes, appending each to ``procs`` as it starts (so that the caller
    stops every one of them, whatever fails here)."""

    def metrics(process: str, port: int) -> list[str]:
        return [] if metrics_port is None else ["--metrics-port", str(port), "--metrics-file", str(run_dir / PROM_DIR / f"{process}.json")]

    base = [sys.executable, "-m", "diloco.sim.child"]
    if cfg.mode == "diloco":
        port_file = run_dir / "coordinator.port.json"
        site_port_files = {str(s): port_file for s in range(cfg.sites)}
        if wan is not None:
            site_port_files = _start_wan(wan, run_dir, port_file, procs, deadline=start + 60)
            say(f"WAN emulation: {_describe_wan(wan)}")
        # Checkpoints every round: a coordinator killed by a fault resumes from them.
        (run_dir / SITES_DONE_FILE).unlink(missing_ok=True)  # a resumed run's sites are about to start again
        coordinator = base + [
            "coordinator", *common, "--port-file", str(port_file), "--checkpoint-dir", str(run_dir / "checkpoints" / "coordinator"),
            "--sites-done-file", str(run_dir / SITES_DONE_FILE), *metrics("coordinator", metrics_port or 0),
        ]  # fmt: skip
        if status_port is not None:
            coordinator += ["--status-port", str(status_port), "--status-file", str(run_dir / STATUS_FILE)]
        procs.append(_start("coordinator", coordinator, run_dir, _next_incarnation(run_dir, "coordinator"), _fired_events(run_dir), zygote=zygote))
        # The sites start at the same time (importing torch, building the model and the
        # data take most of a start) and connect once the coordinator's port file exists.
        for s in range(cfg.sites):
            ranks = cfg.layout_of(s).ranks
            # A site of several ranks is a torchrun group, as in a real run.
            launcher = base if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "diloco.sim.child"]
            site = launcher + ["site", *common, "--site-id", str(s), "--coordinator-port-file", str(site_port_files[str(s)]), "--checkpoint-dir", str(run_dir / "checkpoints" / f"site-{s}"), *metrics(f"site-{s}", 0)]
            # Behind the emulator, sites yield the cores to it: its deliveries (the links' RTT)
            # must not wait for a training step (docs/wan.md).
            procs.append(_start(f"site {s}", site, run_dir, _next_incarnation(run_dir, f"site {s}"), _fired_events(run_dir), nice=SITE_NICE if wan else 0, zygote=zygote))
        coordinator_proc = next(p for p in procs if p.name == "coordinator")
        port = _wait_port(port_file, coordinator_proc, deadline=start + 120)
        coordinator_proc.cmd += ["--port", str(port)]  # a restarted coordinator listens where the sites call
        say(f"coordinator on 127.0.0.1:{port}; {cfg.sites} site(s) started")
        if metrics_port is not None:
            # Written before the port file; a restarted coordinator serves /metrics where it did.
            where = json.loads((run_dir / PROM_DIR / "coordinator.json").read_text())
            coordinator_proc.cmd += ["--metrics-port", str(where["port"])]
            say(f"Prometheus metrics: coordinator {where['url']}; each site's address in {run_dir / PROM_DIR}/site-<id>.json")
        if status_port is not None:
            # Written before the port file; a restarted coordinator serves the page where it did.
            page = json.loads((run_dir / STATUS_FILE).read_text())
            coordinator_proc.cmd += ["--status-port", str(page["port"])]
            say(f"status page: {page['url']}{access_hint(cfg.security)} (address in {run_dir / STATUS_FILE})")
    else:
        init_file = run_dir / "pg_init"
        init_file.unlink(missing_ok=True)
        for rank in range(cfg.workers):
            args = ["worker", *common, "--rank", str(rank), "--world-size", str(cfg.workers), "--init-file", str(init_file)]
            procs.append(_start(f"rank {rank}", base + args, run_dir, zygote=zygote))


WAN_DIR = "wan"  # the emulator's spec, the ports it listens on (one per site), its stats
SITE_NICE = 10


def _start_wan(wan: WanPlan, run_dir: Path, upstream: Path, procs: list[_Proc], deadline: float) -> dict[str, Path]:
    """Starts the WAN emulator between the sites and the coordinator; returns, per site, the
    port file it reads its coordinator address from (the emulator's port for its link)."""
    wan_dir = run_dir / WAN_DIR
    shutil.rmtree(wan_dir, ignore_errors=True)
    wan_dir.mkdir(parents=True)
    spec = {"upstream_port_file": str(upstream), "links": {s: l.to_dict() for s, l in wan.sites.items()}, "coordinator": wan.coordinator.to_dict() if wan.coordinator else None}
    write_json_atomic(wan_dir / "spec.json", spec)
    cmd = [sys.executable, "-m", "diloco.sim.wan", "--spec", str(wan_dir / "spec.json"), "--ports-out", str(wan_dir / "ports.json"), "--stats-out", str(wan_dir / "stats.json")]
    proc = _start("wan", cmd, run_dir, extra=False)
    proc.service = True
    procs.append(proc)
    ports_file = wan_dir / "ports.json"
    while not ports_file.exists():
        if proc.popen.poll() is not None:
            raise SimError(_failure(proc))
        if time.monotonic() > deadline:
            raise SimError(f"the WAN emulator did not start listening in time; see {proc.log_path}")
        time.sleep(0.05)
    ports = json.loads(ports_file.read_text())
    files = {}
    for site, port in ports.items():
        files[site] = wan_dir / f"site-{site}.port.json"
        write_json_atomic(files[site], {"host": "127.0.0.1", "port": int(port)})
    return files


def _describe_wan(wan: WanPlan) -> str:
    def one(spec: LinkSpec) -> str:
        rate = "unlimited" if spec.up_mbit is None and spec.down_mbit is None else f"{spec.up_mbit or 'unlimited'}/{spec.down_mbit or 'unlimited'} Mbit/s up/down"
        return f"{rate}, RTT {spec.rtt_ms:g} ms" + (f" ± {spec.jitter_ms:g} ms" if spec.jitter_ms else "") + (f", window {spec.window_kb:g} KiB per connection" if spec.window_kb else "")

    distinct = {one(spec) for spec in wan.sites.values()}
    sites = f"each site {distinct.pop()}" if len(distinct) == 1 else "; ".join(f"site {s}: {one(spec)}" for s, spec in wan.sites.items())
    return sites + (f"; the coordinator's link {one(wan.coordinator)}" if wan.coordinator else "")


def check_before_start(cfg: RunConfig) -> None:
    """What would make a process fail at start, found before any starts (ConfigError naming
    the field or the file): no GPU for device=cuda, a model factory that does not build, an
    init file that does not load or does not fit the model the sites build."""
    try:
        resolve_device(cfg.device)
        if cfg.init.source == "file" or not is_builtin(cfg.model) or cfg.fragments > 1:
            model = build_model(cfg.model, cfg.seed)
            if cfg.fragments > 1:
                split_fragments({n: p.shape for n, p in model.named_parameters()}, cfg.fragments)
            if cfg.init.source == "file":
                problems = mismatches(fingerprint(load_init_file(str(cfg.init.path))), fingerprint(dict(model.named_parameters())).values())
                if problems:
                    raise ConfigError(f"init.path={cfg.init.path}: does not fit model={cfg.model.name}: " + "; ".join(problems))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


CHILD = [sys.executable, "-m", "diloco.sim.child"]  # a process the zygote can fork
PIDS_FILE = "pids.json"  # each process's pid, by name (the last incarnation's)


def _start(
    name: str, cmd: list[str], run_dir: Path, incarnation: int = 0, skip_faults: list[int] | None = None, extra: bool = True, nice: int = 0,
    zygote: Zygote | None = None,
) -> _Proc:  # fmt: skip
    suffix = f".{incarnation}" if incarnation else ""
    log_path = run_dir / "logs" / (name.replace(" ", "") + suffix + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "wb")
    env = _child_env()
    args = ["--incarnation", str(incarnation), "--skip-faults", ",".join(map(str, skip_faults or []))] if extra else []
    popen: subprocess.Popen[bytes] | Forked
    if zygote is not None and cmd[: len(CHILD)] == CHILD:
        try:
            popen = zygote.spawn(cmd[len(CHILD) :] + args, log_path, env, nice)  # its own session, as below
        except RuntimeError as e:  # the zygote died (its traceback is on this process's stderr)
            log_file.close()
            raise SimError(f"{name}: {e}") from None
    else:
        # Its own process group, so that stopping it also stops what it started (torchrun's ranks).
        popen = subprocess.Popen(
            cmd + args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=_child_setup(nice), start_new_session=True
        )
    pids = run_dir / PIDS_FILE
    write_json_atomic(pids, {**(json.loads(pids.read_text()) if pids.exists() else {}), name: popen.pid})
    return _Proc(name, popen, log_path, log_file, cmd=list(cmd), incarnation=incarnation, nice=nice, zygote=zygote)


def _child_setup(nice: int) -> Callable[[], None]:
    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    return setup


def _refused_pushes(metrics: list[MetricsLine]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in metrics:
        for r in m.refused or []:
            counts[r["site"]] = counts.get(r["site"], 0) + 1
    return dict(sorted(counts.items()))


def _check_resumable(cfg: RunConfig, run_dir: Path) -> None:
    if cfg.mode != "diloco":
        raise SimError(f"only mode=diloco runs can be resumed (mode={cfg.mode} keeps no checkpoints)")
    config_path = run_dir / "config.json"
    if not config_path.exists() or not (run_dir / "checkpoints").is_dir():
        raise SimError(f"nothing to resume in {run_dir}: no config.json or checkpoints/ (start it without resume)")
    saved = json.loads(config_path.read_text())
    if saved != run_config_to_dict(cfg):
        diff = sorted(k for k in set(saved) | set(run_config_to_dict(cfg)) if saved.get(k) != run_config_to_dict(cfg).get(k))
        raise SimError(f"cannot resume {run_dir} with another config (differs in: {', '.join(diff)})")


def _next_incarnation(run_dir: Path, name: str) -> int:
    """0 for a fresh run; after a resume, one more than the process's last log."""
    base = name.replace(" ", "")
    logs = [p.stem for p in (run_dir / "logs").glob("*.log") if p.stem == base or p.stem.startswith(base + ".")]
    if not logs:
        return 0
    return 1 + max(int(stem.split(".")[1]) if "." in stem else 0 for stem in logs)


def _fired_events(run_dir: Path) -> list[int]:
    return sorted({e["event"] for e in read_fired(run_dir)})


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SimStopped(f"stopped by signal {signum}")


def _wait_port(port_file: Path, coordinator: _Proc, deadline: float) -> int:
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(json.loads(port_file.read_text())["port"])
        if coordinator.popen.poll() is not None:
            raise SimError(_failure(coordinator))
        time.sleep(0.05)
    raise SimError(f"the coordinator did not start listening in time; see {coordinator.log_path}")


def _failure(p: _Proc) -> str:
    tail = p.log_path.read_text(errors="replace").strip().splitlines()[-5:] if p.log_path.exists() else []
    lines = "\n    ".join(tail)
    return f"{p.name} (pid {p.popen.pid}) exited with code {p.popen.returncode}; log: {p.log_path}\n    {lines}"


def _is_torchrun(cmd: list[str]) -> bool:
    return "torch.distributed.run" in cmd


def _live_progress(cfg: RunConfig, live: ProgressConfig | None, say: Callable[[str], None]) -> LiveProgress:
    """The run's progress bar (or plain lines): the open round's inner steps across the sites
    (mode=diloco: the baselines' ranks write no progress files)."""
    schedule = cfg.schedule
    tracker = ProgressTracker(rounds=cfg.sync_rounds, sites=cfg.sites, round_steps=schedule.round_steps, train_rounds=schedule.train_rounds, early=schedule.early)
    return LiveProgress(live if live is not None and cfg.mode == "diloco" else OFF, say, tracker, label="sites")


def _supervise(procs: list[_Proc], run_dir: Path, cfg: RunConfig, deadline: float, say: Callable[[str], None], live: LiveProgress | None = None) -> None:
    shown = 0
    handled = 0  # fired fault events already read
    kills: list[dict[str, Any]] = []  # planned kills whose process has not been seen dead yet
    metrics = run_dir / "metrics.jsonl"
    while True:
        fired = read_fired(run_dir)
        for event in fired[handled:]:
            say(f"fault: {_describe_fired(event)}")
        kills += [e for e in fired[handled:] if "restart_after_s" in e]
        handled = len(fired)
        for p in procs:
            code = p.popen.poll()
            if p.service and code is not None:
                raise SimError(_failure(p))
            if code in (None, 0) or p.restart_at is not None or p.gone:
                continue
            planned = next((e for e in kills if e["process"] == p.name), None)
            # A torchrun group whose rank was SIGKILLed exits with an error code of its own.
            killed = code == -signal.SIGKILL or (_is_torchrun(p.cmd) and code > 0)
            if not killed or planned is None:
                raise SimError(_failure(p))
            kills.remove(planned)
            if planned["restart_after_s"] < 0:
                p.gone = True
            else:
                p.restart_at = time.monotonic() + planned["restart_after_s"]
        for i, p in enumerate(procs):
            if p.restart_at is not None and time.monotonic() >= p.restart_at:
                p.log_file.close()
                procs[i] = _start(p.name, p.cmd, run_dir, p.incarnation + 1, _fired_events(run_dir), nice=p.nice, zygote=p.zygote)
                say(f"started {p.name} again (incarnation {p.incarnation + 1})")
        lines = read_jsonl(metrics) if metrics.exists() else []
        for line in lines[shown:]:
            say(_progress_line(line, cfg))
        shown = len(lines)
        if live is not None and live.enabled:
            live.update(shown, read_positions(run_dir / "progress"))  # the open round's inner steps
        done = [p.service or p.gone or (p.restart_at is None and p.popen.poll() == 0) for p in procs]
        if all(done):
            return
        if cfg.mode == "diloco" and all(d for p, d in zip(procs, done) if p.name != "coordinator"):
            # No site is left to come back (killed for good, or left): the coordinator need not
            # wait its linger_s for them after the last round.
            (run_dir / SITES_DONE_FILE).touch()
        if time.monotonic() > deadline:
            running = ", ".join(p.name for p in procs if p.popen.poll() is None)
            raise SimError(f"the run did not finish before sim.timeout_s; still running: {running}")
        time.sleep(0.2)


def _describe_fired(e: dict[str, Any]) -> str:
    details = ", ".join(f"{k}={e[k]}" for k in ("round", "phase", "seconds", "factor", "restart_after_s") if k in e)
    return f"{e['kind']} ({e['process']}; {details})"


def _progress_line(m: dict[str, Any], cfg: RunConfig) -> str:
    kind, key = ("eval_bpb", "eval_bpb") if cfg.data.format == "bytes" else ("eval_loss", "eval_loss")
    ev = f"{m[key]:.4f}" if m.get(key) is not None else "  -   "
    loss = f"{m['train_loss']:.4f}" if m.get("train_loss") is not None else "-"
    return (
        f"round {m['round'] + 1:>3}/{cfg.sync_rounds}  workers {len(m['participants'])}  train_loss {loss}  "
        f"{kind} {ev}  up {m['bytes_up'] / 1e6:8.2f} MB  down {(m['bytes_down'] or 0) / 1e6:8.2f} MB  {m['elapsed_s']:7.1f} s"
    )


def _stop_all(procs: list[_Proc]) -> None:
    for p in procs:
        if p.service and p.popen.poll() is None:
            p.popen.terminate()  # the WAN emulator writes its stats on SIGTERM
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)  # the process and whatever it started
        except (ProcessLookupError, PermissionError):
            if p.popen.poll() is None:  # forked an instant ago: not yet the leader of its session
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        p.log_file.close()


def _summarize(cfg: RunConfig, run_dir: Path, wall_s: float, wan: WanPlan | None = None) -> dict[str, Any]:
    g = records.read(run_dir / "global.json", GlobalRecord)
    workers = {p.stem: records.read(p, WorkerRecord) for p in sorted((run_dir / "workers").glob("*.json"))}
    metrics = records.read_metrics(run_dir / "metrics.jsonl")
    site_hashes = {sid: w.global_sha256 for sid, w in sorted(workers.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0])}
    # Goodput: tokens in committed (not rejected) rounds over every token any site trained,
    # counting the work of killed processes and dropped rounds (progress/<site>.<incarnation>).
    trained = sum(records.read(p, ProgressRecord).tokens for p in (run_dir / "progress").glob("*.json"))
    committed = sum(m.tokens + sum(p["tokens"] for p in m.merged) for m in metrics if not m.rejected)
    summary = Summary(
        mode=cfg.mode,
        sites=cfg.workers,
        sync_every=cfg.sync_every,
        rounds=cfg.rounds,
        rounds_committed=g.rounds_committed,
        rounds_rejected=sum(1 for m in metrics if m.rejected),
        refused_pushes=_refused_pushes(metrics),
        faults_injected=read_fired(run_dir),
        goodput=round(committed / trained, 4) if trained else None,
        model=cfg.model.name,
        codec=cfg.codec.describe(),
        codec_down=cfg.downlink_codec.describe(),
        seed=cfg.seed,
        params=g.params,
        tokens=sum(m.tokens for m in metrics),
        final_eval_bpb=g.final_eval_bpb,
        final_eval_loss=g.final_eval_loss,
        eval_by=g.eval_by,
        final_train_loss=metrics[-1].train_loss if metrics else None,
        bytes_up=sum(m.bytes_up for m in metrics),
        bytes_down=sum(m.bytes_down or 0 for m in metrics),
        wall_s=round(wall_s, 3),
        global_sha256=g.global_sha256,
        site_global_sha256=site_hashes,
        hashes_equal=all(h == g.global_sha256 for h in site_hashes.values()),
        # Per process, in MiB; in the baselines rank 0 plays the coordinator's part in global.json.
        peak_rss_mb={**({"coordinator": g.peak_rss_mb} if cfg.mode == "diloco" else {}), **{sid: w.peak_rss_mb for sid, w in workers.items()}},
        run_dir=str(run_dir),
        **_overlap_summary(cfg, workers),
        wan=wan.to_dict() if wan is not None else None,
    )
    return records.to_dict(summary)


def _with_mean(per_site: dict[str, float]) -> dict[str, float]:
    return {**per_site, "run": round(sum(per_site.values()) / len(per_site), 4)} if per_site else {}


def _overlap_summary(cfg: RunConfig, workers: dict[str, WorkerRecord]) -> dict[str, Any]:
    """Per site and for the run: compute utilization, stalls, bytes per fragment."""
    if cfg.mode != "diloco":
        return {}
    util = _with_mean({sid: w.compute_utilization for sid, w in workers.items() if w.compute_utilization is not None})
    until = _with_mean({sid: w.utilization_until_last_step for sid, w in workers.items() if w.utilization_until_last_step is not None})
    frags: dict[str, dict[str, int]] = {}
    for w in workers.values():
        for f, b in (w.fragment_bytes or {}).items():
            into = frags.setdefault(f, {"up": 0, "down": 0})
            into["up"] += b["up"]
            into["down"] += b["down"]
    return {
        "compute_utilization": util or None,
        "utilization_until_last_step": until or None,
        "stall_s": {sid: w.stall_s for sid, w in workers.items() if w.stall_s is not None} or None,
        "fragment_bytes": dict(sorted(frags.items())) or None,
    }
