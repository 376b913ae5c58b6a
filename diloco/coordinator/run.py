"""The coordinator process: θ_0 from the model config, a gRPC server, metrics, a final report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import CheckpointError, load_latest
from diloco.config import RunConfig
from diloco.coordinator.metrics import MetricsReporter
from diloco.coordinator.service import Coordinator, CoordinatorConfig
from diloco.data import eval_batches, load_corpus
from diloco.faults import FaultPlan, coordinator_hooks
from diloco.io import limit_malloc_arenas, peak_rss_mb, write_json_atomic
from diloco.model import build_model, count_params
from diloco.site.inner import evaluate_bpb
from diloco.transport import serve


@dataclass(frozen=True)
class CoordinatorOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (written to port_file)
    min_sites: int | None = None  # sites a round waits for; default: RunConfig.sites
    linger_s: float = 60.0  # after the last round, how long to wait for every site to leave
    port_file: str | None = None
    checkpoint_dir: str | None = None  # checkpoint every round there; resume from it on start
    faults: FaultPlan | None = None  # injected faults (simulation only)


def run_coordinator(cfg: RunConfig, opts: CoordinatorOptions, run_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serves rounds 0 .. cfg.rounds-1, then writes run_dir/global.json and returns its content."""
    torch.set_num_threads(cfg.threads)
    limit_malloc_arenas()  # memory must not grow with the number of sites (see diloco/io.py)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.model, cfg.seed)
    corpus = load_corpus(cfg.data, cfg.model.context, num_shards=cfg.sites)
    batches = eval_batches(corpus.heldout, context=cfg.model.context, batch_size=cfg.data.batch_size, num_batches=cfg.data.eval_batches)
    eval_params = dict(model.named_parameters())

    def evaluate(params: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for name, p in eval_params.items():
                p.copy_(params[name])
        return evaluate_bpb(model, batches)

    coordinator = Coordinator(
        dict(model.named_parameters()),
        cfg.outer,
        CoordinatorConfig(
            total_rounds=cfg.rounds,
            min_sites=_min_sites(cfg, opts),
            lease_s=cfg.quorum.lease_s,
            deadline=cfg.quorum.deadline,
            deadline_s=cfg.quorum.deadline_s,
            deadline_factor=cfg.quorum.deadline_factor,
            codec_down=cfg.downlink_codec,
            error_feedback_down=cfg.error_feedback,
            aggregate=cfg.aggregate,
            chunk_bytes=cfg.chunk_bytes,
            snapshot_every=cfg.eval_every,
            checkpoint_dir=opts.checkpoint_dir,
            guard=cfg.guard,
            late=cfg.quorum.late,
            late_discount=cfg.quorum.late_discount,
            max_staleness=cfg.quorum.max_staleness,
        ),
    )
    if opts.checkpoint_dir:
        _resume(coordinator, Path(opts.checkpoint_dir), log)
    reporter = MetricsReporter(run_dir / "metrics.jsonl", coordinator, evaluate, log=log)
    coordinator.on_commit.append(reporter.submit)
    if opts.faults is not None:
        kill_between, kill_mid = coordinator_hooks(opts.faults)
        coordinator.on_commit.append(lambda record: kill_between(record.round))
        coordinator.on_push.append(kill_mid)
    server, port = serve(coordinator, opts.host, opts.port)
    stop_ticker = coordinator.start_ticker()  # leases and deadlines are checked even when nobody calls
    start = time.monotonic()
    try:
        log(f"coordinator listening on {opts.host}:{port}: {count_params(model)} params, {cfg.rounds} rounds, a round needs {_min_sites(cfg, opts)} site(s)")
        if opts.port_file:
            write_json_atomic(Path(opts.port_file), {"port": port, "host": opts.host})
        finished_at: float | None = None
        while not coordinator.wait_all_left(timeout_s=0.5):
            if coordinator.finished:
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > opts.linger_s:
                    log(f"not every site left within {opts.linger_s:.0f}s after the last round; stopping anyway")
                    break
        reporter.close()
        if reporter.final_eval_bpb is None and coordinator.finished:
            # The last round was committed by a predecessor that was killed before evaluating.
            reporter.final_eval_bpb = evaluate(coordinator.global_params())
    finally:
        stop_ticker()
        server.stop(grace=2.0).wait(5.0)
    result = {
        "params": count_params(model),
        "rounds_committed": coordinator.committed_rounds,
        "global_sha256": coordinator.global_sha256(),
        "final_eval_bpb": reporter.final_eval_bpb,
        "site_reported_sha256": coordinator.left_sites(),
        "wall_s": round(time.monotonic() - start, 3),
        "port": port,
        "peak_rss_mb": peak_rss_mb(),
    }
    write_json_atomic(run_dir / "global.json", result)
    log(f"coordinator done: {result['rounds_committed']} rounds, global sha256 {result['global_sha256'][:16]}")
    return result


def _resume(coordinator: Coordinator, directory: Path, log: Callable[[str], None]) -> None:
    """Restores the newest good checkpoint in ``directory``, if any; names the bad ones it skips."""
    loaded = load_latest(directory)
    for problem in loaded.problems if loaded else []:
        log(f"skipping a bad checkpoint: {problem}")
    if loaded is None:
        return
    try:
        coordinator.restore(loaded.state)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{loaded.path}: does not fit this run: {e}") from None
    log(f"resumed from {loaded.path} at round {coordinator.committed_rounds} (global sha256 {coordinator.global_sha256()[:16]})")


def _min_sites(cfg: RunConfig, opts: CoordinatorOptions) -> int:
    return opts.min_sites or cfg.quorum.min_sites or cfg.sites
