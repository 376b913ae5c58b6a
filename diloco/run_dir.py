"""Every path of a run directory, in one place. A process is given the run directory; the names
of what it writes and reads there are ``RunDir``'s, and no other module spells one
(tests/unit/test_run_dir.py looks). What each file holds, field by field: docs/outputs.md
(diloco/app/records.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The typed files' entries (their records: diloco.app.records).
METRICS, GLOBAL, WORKERS, PROGRESS, SUMMARY = "metrics.jsonl", "global.json", "workers/<id>.json", "progress/<site>.<incarnation>.json", "summary.json"
# name -> (what it is, who writes it): the run directory's entries, in the order docs/outputs.md lists them.
ENTRIES: dict[str, tuple[str, str]] = {
    "config.json": ("the resolved run config every process reads (diloco.app.config.run_config_to_dict)", "diloco-sim"),
    "metrics.jsonl": ("one JSON line per committed round", "the coordinator (ddp/single: rank 0)"),
    "global.json": ("the coordinator's report", "the coordinator (ddp/single: rank 0)"),
    "workers/<id>.json": ("one per site (or rank)", "each site / rank"),
    "progress/<site>.<incarnation>.json": ("tokens a site process trained so far, and its round and step", "each site process"),
    "sites_done": ("empty; exists once every site process has exited, so that the coordinator stops waiting for sites to leave", "diloco-sim"),
    "status_page.json": (
        "where the coordinator serves its status page: {host, port, url, tls, client_certificate, token} (diloco-sim's status.port)",
        "the coordinator",
    ),
    "summary.json": ("the run's summary", "diloco-sim"),
    "faults.json": ("the fault events to inject (the `faults` section of diloco-sim)", "diloco-sim"),
    "faults.jsonl": ("one line per fault event that fired: event, kind, process, time, round, …", "the process that suffered it"),
    "checkpoints/coordinator/, checkpoints/site-<i>/": ("atomic checkpoints (coordinator: every round; sites: their own state)", "the coordinator, each site"),
    "logs/<process>.<incarnation>.log": (
        "each process's output: log lines `time [process] LEVEL message` (logging.json=true: one JSON object per line, {time, process, level, message})",
        "diloco-sim",
    ),
    "tb/coordinator/, tb/site-<id>/": (
        "TensorBoard event files (tensorboard.enabled): the run's scalars per round, by round and by tokens (by_tokens/); each site's inner loss, lr and step time per step, and its outer sync's time split per round (docs/observability.md)",
        "the coordinator (ddp/single: rank 0), each site",
    ),
    "pids.json": (
        "each process's pid by name (`coordinator`, `site <id>`, `rank <r>`, `wan`; a restarted one's latest): forked processes share the zygote's command line (sim.fork)",
        "diloco-sim",
    ),
    "prometheus/<process>.json": ("where a process serves Prometheus /metrics: {host, port, url} (diloco-sim's metrics.port)", "the coordinator, each site"),
    "plots/*.png": (
        "eval_vs_tokens, train_loss_vs_tokens, eval_vs_bytes (log scale), overview (the three side by side), timeline (per site and round: pushed, absent, evicted, late, dropped, refused, killed, rejoined)",
        "diloco-sim, at the end (sim.plots)",
    ),
    "credentials/": (
        "the run's own CA, the coordinator's certificate and each site's certificate and token (diloco-certs' layout) unless security.dir is set",
        "diloco-sim",
    ),
    "coordinator.port.json": ("where the coordinator listens: {host, port} (its port is chosen at start)", "the coordinator (diloco-sim)"),
    "wan/": ("the link emulator's spec, the ports it listens on (one per site) and its byte counts (wan.*)", "diloco-sim"),
    "pg_init": ("the rendezvous file of the data-parallel baseline's process group (mode=ddp)", "diloco-sim"),
}


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # ---- files ---------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def global_record(self) -> Path:
        return self.root / "global.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def sites_done(self) -> Path:
        return self.root / "sites_done"

    @property
    def status_page(self) -> Path:
        return self.root / "status_page.json"

    @property
    def faults(self) -> Path:
        return self.root / "faults.json"

    @property
    def faults_fired(self) -> Path:
        return self.root / "faults.jsonl"

    @property
    def pids(self) -> Path:
        return self.root / "pids.json"

    @property
    def coordinator_port(self) -> Path:
        return self.root / "coordinator.port.json"

    @property
    def pg_init(self) -> Path:
        return self.root / "pg_init"

    def worker(self, worker_id: str | int) -> Path:
        return self.workers_dir / f"{worker_id}.json"

    def progress(self, site_id: str, incarnation: int) -> Path:
        return self.progress_dir / f"{site_id}.{incarnation}.json"

    def prometheus(self, process: str) -> Path:
        return self.prometheus_dir / f"{process}.json"

    def log(self, process: str, incarnation_suffix: str = "") -> Path:
        """``logs/<process><suffix>.log`` (the suffix: ``.<incarnation>`` of a restarted process)."""
        return self.logs_dir / f"{process}{incarnation_suffix}.log"

    def tensorboard(self, process: str) -> Path:
        return self.tb_dir / process

    # ---- directories ---------------------------------------------------------------------
    @property
    def workers_dir(self) -> Path:
        return self.root / "workers"

    @property
    def progress_dir(self) -> Path:
        return self.root / "progress"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def coordinator_checkpoints(self) -> Path:
        return self.checkpoints_dir / "coordinator"

    def site_checkpoints(self, site: str | int) -> Path:
        return self.checkpoints_dir / f"site-{site}"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def tb_dir(self) -> Path:
        return self.root / "tb"

    @property
    def prometheus_dir(self) -> Path:
        return self.root / "prometheus"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    @property
    def credentials_dir(self) -> Path:
        return self.root / "credentials"

    @property
    def wan_dir(self) -> Path:
        return self.root / "wan"

    # ---- what a fresh run clears -----------------------------------------------------------
    @property
    def stale_files(self) -> tuple[Path, ...]:
        """Files a new run in this directory must not find from an earlier one."""
        return (self.global_record, self.summary, self.coordinator_port, self.status_page, self.pids)

    @property
    def stale_dirs(self) -> tuple[Path, ...]:
        """Directories a fresh (not resumed) run starts without."""
        return (self.checkpoints_dir, self.progress_dir, self.workers_dir, self.logs_dir, self.plots_dir, self.tb_dir, self.credentials_dir)

    @property
    def is_run(self) -> bool:
        """It holds a run (what diloco-report reads): metrics.jsonl."""
        return self.metrics.exists()
