"""The coordinator process: θ₀ (from the model config, a file, or the first site), a gRPC
server, metrics with evaluation where it can be done, a final report."""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.app import records
from diloco.app.config import ConfigError, RunConfig
from diloco.app.metrics import MetricsReporter
from diloco.app.records import GlobalRecord
from diloco.checkpoint import CheckpointError, load_latest
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.init_file import load_init_file
from diloco.data import DataError, eval_batches, load_corpus
from diloco.fields import setting
from diloco.io import limit_malloc_arenas, peak_rss_mb, write_json_atomic
from diloco.model import build_model
from diloco.observe.config import MetricsConfig
from diloco.observe.coordinator_observer import CoordinatorObserver
from diloco.observe.logs import log_at
from diloco.observe.status_page import StatusConfig, StatusPage, serve_status_page
from diloco.outer.fragments import describe
from diloco.run_dir import RunDir
from diloco.security.store import RunCredentials
from diloco.site.inner import evaluate_loss
from diloco.transport import ServerLimits, serve
from diloco.wire.fingerprint import fingerprint, mismatches

Evaluate = Callable[[dict[str, torch.Tensor]], float]


@dataclass(frozen=True)
class CoordinatorOptions:
    """The coordinator process's own keys (conf/coordinator.yaml's ``coordinator:``)."""

    host: str = setting("127.0.0.1", doc="the address the coordinator listens on: 0.0.0.0 to accept sites from other hosts")
    port: int = setting(50051, doc="its gRPC port; 0: any free port (written to port_file)")
    min_sites: int | None = setting(None, doc="a round never closes with fewer pushes; null: quorum.min_sites, else a majority of the sites")
    linger_s: float = setting(60.0, doc="after the last round, how long to wait for every site to leave")
    sites_done_file: str | None = setting(None, doc="diloco-sim's: once this file exists (every site process has exited), no linger")
    port_file: str | None = setting(None, doc="if set, the bound port is written there as JSON (useful with port=0)")
    checkpoint_dir: str | None = setting(None, doc="if set, an atomic checkpoint after every round; a restart on it resumes there")
    max_tokens_per_push: int = setting(2**40, doc="the largest averaging weight (tokens) one push may declare")
    max_rpcs: int = setting(128, doc="concurrent calls in all; more are refused at once (sites retry)")
    max_rpcs_per_site: int = setting(32, doc="concurrent calls naming one site id")
    stream_idle_s: float = setting(30.0, doc="a push or pull that moves no message this long is cancelled")
    max_concurrent_pushes: int = setting(
        2, doc="pushes held at once (each its payloads, or a float32 staging copy); memory O(params x this), whatever the sites"
    )
    staging_timeout_s: float = setting(30.0, doc="a push waits this long for one of those slots, then is told to retry (resource_exhausted)")
    staging_stall_s: float = setting(
        2.0, doc="a held push that waited this long for its next chunk gives its slot to a waiting push and is refused (retried); .inf: never"
    )
    shards: int = setting(
        1, doc="the parameters cut into this many ranges of whole tensors, each added and committed on its own thread; θ is the same bits for any cut"
    )
    reflection: bool = setting(False, doc="gRPC server reflection too (grpcurl lists the services); the standard health service is always on")
    metrics: MetricsConfig = setting(doc="this process's Prometheus endpoint (the metrics section)", factory=MetricsConfig)
    status: StatusConfig = setting(doc="the read-only status page (the status section)", factory=StatusConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.reflection, bool):
            raise ConfigError(f"coordinator.reflection={self.reflection!r}: must be true or false")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ConfigError(f"coordinator.shards={self.shards!r}: must be an integer >= 1")


def run_coordinator(
    cfg: RunConfig, opts: CoordinatorOptions, run_dir: Path, log: Callable[[str], None] = print, attach: Callable[[Coordinator], None] | None = None
) -> dict[str, Any]:
    """Serves rounds 0 .. cfg.rounds-1, then writes run_dir/global.json and returns its content.
    ``attach``: called with the Coordinator before it serves (the simulation's fault hooks)."""
    torch.set_num_threads(cfg.threads)
    limit_malloc_arenas()  # memory must not grow with the number of sites (see diloco/io.py)
    run_dir.mkdir(parents=True, exist_ok=True)
    # TensorBoard and /metrics (docs/observability.md); a metrics port in use fails here, first.
    observer = CoordinatorObserver.start(cfg.tensorboard, opts.metrics, run_dir, log, cfg.security)
    page: StatusPage | None = None
    try:
        # The status page (a port in use fails here too); it shows the coordinator once built.
        page = _status_page(cfg, opts, run_dir, log)
        return _serve_run(cfg, opts, run_dir, log, page.chain(attach) if page else attach, observer)
    finally:
        if page is not None:
            page.close()
        observer.close()


def _status_page(cfg: RunConfig, opts: CoordinatorOptions, run_dir: Path, log: Callable[[str], None]) -> StatusPage | None:
    """The read-only status page on opts.status.port (docs/observability.md), or None when off."""
    if not opts.status.enabled:
        return None
    about = {"sites": cfg.sites, "H": cfg.sync.every, "model": cfg.model.name, "codec": cfg.codec.describe()}
    page = serve_status_page(opts.status, cfg.security, RunDir(run_dir).metrics, about)
    log(f"coordinator: status page on {page.url} ({page.security.describe()})")
    return page


def _serve_run(
    cfg: RunConfig,
    opts: CoordinatorOptions,
    run_dir: Path,
    log: Callable[[str], None],
    attach: Callable[[Coordinator], None] | None,
    observer: CoordinatorObserver,
) -> dict[str, Any]:
    theta0, source = initial_params(cfg)
    evaluate = coordinator_evaluator(cfg, theta0, log)
    coordinator = Coordinator(theta0, cfg.outer_step, coordinator_config(cfg, opts, source, evaluate is not None))
    del theta0  # the coordinator holds its own copy: this one would stay for the whole run (4 bytes a parameter)
    resumed = None
    if opts.checkpoint_dir:
        resumed = _resume(coordinator, Path(opts.checkpoint_dir), log)
    eval_by = "coordinator" if evaluate is not None else "sites"
    fatal, failed = _failure_alarm(log)
    coordinator.on_fatal.append(fatal)
    reporter = MetricsReporter(
        RunDir(run_dir).metrics, coordinator, evaluate, eval_by=eval_by, bytes_data=cfg.data.format == "bytes", log=log, on_fatal=fatal,
        listeners=observer.line_listeners,
    )  # fmt: skip
    coordinator.on_commit.append(reporter.submit)
    observer.attach(coordinator)
    coordinator.on_init.append(
        lambda who: log(f"θ₀ received from {who}: {_count(coordinator)} params{_cut(coordinator)}, sha256 {coordinator.global_sha256()[:16]}")
    )
    if attach is not None:
        attach(coordinator)
    limits = ServerLimits(max_rpcs=opts.max_rpcs, max_rpcs_per_site=opts.max_rpcs_per_site, stream_idle_s=opts.stream_idle_s)
    server, port = serve(
        coordinator,
        opts.host,
        opts.port,
        security=cfg.security,
        limits=limits,
        observer=observer.metrics,
        serving=not coordinator.finished,
        reflection=opts.reflection,
    )
    # The health service: SERVING while rounds are taken; NOT_SERVING after the last, or a failure.
    coordinator.on_commit.append(lambda _record: server.set_serving(not coordinator.finished and coordinator.failed is None))
    coordinator.on_fatal.append(lambda _what, _e: server.set_serving(False))
    stop_ticker = coordinator.start_ticker()  # leases and deadlines are checked even when nobody calls
    start = time.monotonic()
    try:
        what = f"{_count(coordinator)} params from {source}{_cut(coordinator)}" if coordinator.ready else "θ₀ from the first site that joins (init=site)"
        log(
            f"coordinator listening on {opts.host}:{port}: {what}, {cfg.sync_rounds} rounds{_fragments(cfg)}, a round needs {_min_sites(cfg, opts)} site(s), evaluation by the {eval_by}; {cfg.security.describe()}"
        )
        if opts.port_file:
            write_json_atomic(Path(opts.port_file), {"port": port, "host": opts.host})
        _wait_until_done(coordinator, opts.linger_s, log, failed, Path(opts.sites_done_file) if opts.sites_done_file else None)
        reporter.close()
        if reporter.final_eval_loss is None and coordinator.finished and evaluate is not None:
            # The last round was committed by a predecessor that was killed before evaluating.
            reporter.set_final(evaluate(coordinator.global_params()))
    finally:
        stop_ticker()
        server.stop(grace=2.0).wait(5.0)
    result = GlobalRecord(
        params=_count(coordinator),
        init_from=coordinator.init_from if coordinator.ready else None,
        rounds_committed=coordinator.committed_rounds,
        global_sha256=coordinator.global_sha256(),
        eval_by=eval_by,
        final_eval_loss=reporter.final_eval_loss,
        final_eval_bpb=reporter.final_eval_bpb,
        site_reported_sha256=coordinator.left_sites(),
        wall_s=round(time.monotonic() - start, 3),
        port=port,
        peak_rss_mb=peak_rss_mb(),
        min_sites=_min_sites(cfg, opts),
        security=cfg.security.describe(),
        resumed_from=resumed,
        refused_pushes=coordinator.refusals() or None,
        commit_s_median=_median_parts(coordinator.commit_timings()),
        fragments=describe(coordinator.fragments, {n: s.shape for n, s in coordinator.specs.items()}) if cfg.sync.fragments > 1 and coordinator.ready else None,
    )
    records.write(RunDir(run_dir).global_record, result)
    log(f"coordinator done: {result.rounds_committed} rounds, global sha256 {result.global_sha256[:16]}")
    return records.to_dict(result)


def coordinator_config(cfg: RunConfig, opts: CoordinatorOptions, init_source: str, evaluates: bool) -> CoordinatorConfig:
    """The coordinator's part of the run config. ``evaluates``: the coordinator evaluates θ
    (it keeps snapshots for it), else the sites are asked to (unless eval_by=coordinator)."""
    fragments = cfg.sync.fragments
    return CoordinatorConfig.of_run(
        cfg.settings,
        min_sites=_min_sites(cfg, opts),
        quorum=cfg.quorum,
        aggregate=str(cfg.aggregate),
        chunk_bytes=cfg.chunk_bytes,
        snapshot_every=cfg.eval_every * fragments if evaluates else 0,
        checkpoint_dir=opts.checkpoint_dir,
        init_source=init_source,
        site_eval_every=cfg.eval_every * fragments if not evaluates and cfg.eval_by != "coordinator" else 0,
        guard=cfg.guard,
        robust=cfg.robust,
        sites=_issued_sites(cfg),
        max_sites=cfg.sites,
        max_tokens_per_push=opts.max_tokens_per_push,
        max_concurrent_pushes=opts.max_concurrent_pushes,
        staging_timeout_s=opts.staging_timeout_s,
        staging_stall_s=opts.staging_stall_s,
        shards=opts.shards,
    )


_COMMIT_PARTS = ("receive_s", "lock_s", "commit_s", "mean_s", "step_s", "encode_s", "record_s", "serve_s", "checkpoint_s", "publish_s")


def _median_parts(timings: list[dict[str, Any]]) -> dict[str, float] | None:
    """The median of each part over the commits that measured it (None: no commit)."""
    out = {k: round(statistics.median(t[k] for t in timings if k in t), 5) for k in _COMMIT_PARTS if any(k in t for t in timings)}
    return out or None


def _fragments(cfg: RunConfig) -> str:
    s = cfg.sync
    return f" ({cfg.rounds} x {s.fragments} fragments split {s.split}, one every {s.round_steps} steps)" if s.fragments > 1 else ""


def _issued_sites(cfg: RunConfig) -> tuple[str, ...] | None:
    """The site ids this run issued credentials for (only they may join); None without credentials."""
    if cfg.security.dir is None:
        return None
    return tuple(sorted(RunCredentials.at(cfg.security.dir).token_table().sites))


def _failure_alarm(log: Callable[[str], None]) -> tuple[Callable[[str, BaseException], None], threading.Event]:
    """A listener for what broke in the background (logged with its traceback) and the event
    it sets, on which the main thread stops and the process exits non-zero."""
    failed = threading.Event()

    def fatal(what: str, e: BaseException) -> None:
        log_at(log, logging.ERROR, f"coordinator failed: {what}: {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}")
        failed.set()

    return fatal, failed


class CoordinatorFailed(RuntimeError):
    """A commit could not be made durable, or a background thread broke: the process must exit
    non-zero so that its supervisor restarts it from the last checkpoint."""


def _wait_until_done(coordinator: Coordinator, linger_s: float, log: Callable[[str], None], failed: threading.Event, sites_done: Path | None = None) -> None:
    """Until every site has left after the last round (an evicted one, cut off near the end,
    may still come back for θ), or ``linger_s`` after it, or, after the last round, once the
    file ``sites_done`` exists (the simulator's word that no site process is left to come
    back). Raises CoordinatorFailed as soon as the coordinator has failed."""
    finished_at: float | None = None
    while not coordinator.wait_all_left(timeout_s=0.5):
        if failed.is_set():
            raise CoordinatorFailed(str(coordinator.failed))
        if coordinator.finished:
            if sites_done is not None and sites_done.exists():
                log("every site process has exited (the simulator says so); not waiting for the sites that did not leave")
                return
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > linger_s:
                log_at(log, logging.WARNING, f"not every site left within {linger_s:.0f}s after the last round; stopping anyway")
                return


def initial_params(cfg: RunConfig) -> tuple[dict[str, torch.Tensor] | None, str]:
    """θ₀ and where it came from: built from the model config (init=model), read from
    init.path (init=file), or None until the first site sends it (init=site)."""
    if cfg.init.source == "site":
        return None, "a site (init=site)"
    if cfg.init.source == "file":
        return load_init_file(str(cfg.init.path)), f"init.path={cfg.init.path}"
    model = build_model(cfg.model, cfg.seed)
    return {n: p.detach() for n, p in model.named_parameters()}, f"model={cfg.model.name} seed={cfg.seed}"


def coordinator_evaluator(cfg: RunConfig, theta0: dict[str, torch.Tensor] | None, log: Callable[[str], None]) -> Evaluate | None:
    """The coordinator's evaluation of θ (held-out loss, nats per token), or None where the
    sites evaluate: with init=site (the coordinator does not know the model), eval_by=sites,
    or (eval_by=auto) when the run's model does not fit θ₀ or the held-out data is not here."""
    if cfg.eval_by == "sites" or theta0 is None:
        return None
    try:
        model = build_model(cfg.model, cfg.seed)
        problems = mismatches(fingerprint(theta0), fingerprint(dict(model.named_parameters())).values())
        if problems:
            raise ConfigError(f"model={cfg.model.name} does not fit θ₀: " + "; ".join(problems))
        corpus = load_corpus(cfg.data, cfg.model.context, num_shards=cfg.sites)
    except (ConfigError, DataError, ValueError) as e:
        if cfg.eval_by == "coordinator":
            raise ConfigError(f"eval_by=coordinator: the coordinator cannot evaluate: {e}") from None
        log(f"the sites evaluate θ (the coordinator cannot: {e})")
        return None
    batches = eval_batches(corpus.heldout, context=cfg.model.context, batch_size=cfg.data.batch_size, num_batches=cfg.data.eval_batches)
    eval_params = dict(model.named_parameters())

    def evaluate(params: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for name, p in eval_params.items():
                p.copy_(params[name])
        return evaluate_loss(model, batches)[0]

    return evaluate


def _count(coordinator: Coordinator) -> int:
    return sum(math.prod(s.shape) for s in coordinator.specs.values())


def _cut(coordinator: Coordinator) -> str:
    """How the parameters are cut into shards (coordinator.shards), for the log; "" for one."""
    sizes = coordinator.shard_sizes()
    return f" cut into {len(sizes)} shards of {', '.join(map(str, sizes))} params" if len(sizes) > 1 else ""


def _resume(coordinator: Coordinator, directory: Path, log: Callable[[str], None]) -> dict[str, Any] | None:
    """Restores the newest good checkpoint in ``directory``, if any (names the bad ones it
    skips); returns what it resumed from (global.json's ``resumed_from``)."""
    loaded = load_latest(directory)
    for problem in loaded.problems if loaded else []:
        log_at(log, logging.WARNING, f"skipping a bad checkpoint: {problem}")
    if loaded is None:
        return None
    try:
        coordinator.restore(loaded.state)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{loaded.path}: does not fit this run: {e}") from None
    log(f"resumed from {loaded.path} at round {coordinator.committed_rounds} (global sha256 {coordinator.global_sha256()[:16]})")
    return {"round": coordinator.committed_rounds, "global_sha256": coordinator.global_sha256()}


def _min_sites(cfg: RunConfig, opts: CoordinatorOptions) -> int:
    """The quorum: as configured, else a majority of the sites, so that a run goes on without
    a site that died (once its lease ends) as long as most sites are alive."""
    return opts.min_sites or cfg.quorum.min_sites or majority(cfg.sites)


def majority(sites: int) -> int:
    return sites // 2 + 1
