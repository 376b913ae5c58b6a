"""The site process: its data shard, the inner trainer, and the outer sync every H steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from diloco.app import records
from diloco.app.config import RunConfig
from diloco.app.records import ProgressRecord, WorkerRecord
from diloco.data import ShardSampler, eval_batches, load_corpus
from diloco.fields import setting
from diloco.io import peak_rss_mb, write_json_atomic
from diloco.model import build_model, load_parallelize
from diloco.observe.config import MetricsConfig
from diloco.observe.progress import OFF, LiveProgress, ProgressConfig, ProgressTracker, SiteStep
from diloco.observe.site_observer import SiteObserver
from diloco.outer import params_sha256
from diloco.run_dir import RunDir
from diloco.site.checkpoint import Restored, SiteCheckpointer
from diloco.site.device import configure_cuda, resolve_device
from diloco.site.inner import InnerTrainer, evaluate_loss
from diloco.site.layouts.build import build_layout, close_site_group, init_site_group
from diloco.site.loop import RoundLoop
from diloco.site.outer_sync import OuterSync, PendingRound, SyncOptions
from diloco.transport import CoordinatorClient


class SiteHooks(Protocol):
    """Calls into a site process at its fixed points (the simulation's fault injection)."""

    def wrap(self, client: Any) -> Any:
        """The client the site calls the coordinator through."""

    def before_push(self, round: int) -> None: ...

    def after_step(self, round: int, step: int, steps: int, step_s: float) -> None:
        """After inner step ``step`` (0-based) of ``steps`` in ``round``, which took ``step_s``."""

    def diverges(self, round: int, step: int, steps: int) -> bool:
        """Whether a NaN appears in the site's parameters after that step (an injected divergence)."""


@dataclass(frozen=True)
class SiteOptions:
    """The site process's own keys (conf/site.yaml's ``site:``; ``id`` is ``site_id``)."""

    site_id: str = setting("0", doc="this site's id: its credentials' name, and its data shard when it is a number")
    coordinator: str = setting("127.0.0.1:50051", doc="the coordinator's host:port")
    shard: int | None = setting(None, doc="the data shard in 0..sites-1; null: the site id")
    connect_timeout_s: float = setting(120.0, doc="how long to wait for the coordinator to answer at all")
    incarnation: int = setting(0, doc="how many times this site was started again (its progress file's name; diloco-sim's)")
    checkpoint_dir: str | None = setting(
        None, doc="if set, the site's own checkpoint after every round (inner optimizer, sampler, residual); restored on start"
    )
    # Simulation only: the coordinator is started at the same time as the site and writes the
    # port it listens on here; the site reads it once it is ready to connect.
    coordinator_port_file: str | None = setting(None, doc="diloco-sim's: the coordinator's port, read from this file once it exists")
    gpu: int | None = setting(None, doc="device=cuda: which visible GPU (modulo their number); null: LOCAL_RANK (torchrun) or 0")
    metrics: MetricsConfig = setting(doc="this site's Prometheus endpoint (the metrics section; off by default)", factory=MetricsConfig)
    progress: ProgressConfig = setting(OFF, doc="live progress on the terminal (diloco-site's progress section; simulated sites: off)")
    stated: tuple[str, ...] = setting(
        (),
        doc="the run settings this site's configuration set explicitly (stated at Join, where other values are refused); diloco-site: its command line's",
    )

    def coordinator_address(self) -> str:
        """Where to call the coordinator: ``coordinator``, or what the port file says once it exists."""
        if self.coordinator_port_file is None:
            return self.coordinator
        path, deadline = Path(self.coordinator_port_file), time.monotonic() + self.connect_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no coordinator port in {path} after {self.connect_timeout_s:.0f}s")
            time.sleep(0.05)
        where = json.loads(path.read_text())
        return f"{where['host']}:{where['port']}"

    def data_shard(self, num_shards: int) -> int:
        shard = self.shard if self.shard is not None else int(self.site_id) if self.site_id.isdigit() else None
        if shard is None or not 0 <= shard < num_shards:
            raise ValueError(f"site.shard={shard}: set it to a data shard in 0..{num_shards - 1} for site {self.site_id!r}")
        return shard


def _silent(_msg: str) -> None:
    pass


def _restore(checkpointer: SiteCheckpointer | None, sync: OuterSync, site_id: str, log: Callable[[str], None]) -> Restored | None:
    """Restores the site's own checkpoint if it has one; ``exact`` when the sampler and residual
    came back too (else the data must be moved on to where the run is)."""
    restored = checkpointer.restore(round=sync.round, global_sha256=sync.global_sha256(), set_residual=sync.set_residual) if checkpointer else None
    if restored is None:
        log(f"site {site_id}: no checkpoint of this run; the inner optimizer state starts fresh")
        return None
    what = "optimizer, sampler and residual" if restored.exact else "optimizer state only (rounds were committed since)"
    log(f"site {site_id}: restored its round-{restored.round} checkpoint: {what}; θ hash matches: {restored.hash_matches}")
    return restored


def _traffic(per_rank: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """Bytes and outer-sync seconds (median per round of each part) of the site's ranks."""
    return {
        "ranks": ranks,
        "bytes_up": sum(r["bytes_up"] for r in per_rank),
        "bytes_down": sum(r["bytes_down"] for r in per_rank),
        "bytes_up_per_rank": [r["bytes_up"] for r in per_rank],
        "bytes_down_per_rank": [r["bytes_down"] for r in per_rank],
        "sync_s_median_per_rank": [r["sync"] for r in per_rank],
    }


def _sync_record(sync: OuterSync) -> dict[str, Any]:
    """What happened to the site's rounds: hashes, dropped and merged rounds, reconnects."""
    return {
        "rounds": len(sync.stats.round_hashes),
        "round_sha256": {str(r): h for r, h in sorted(sync.stats.round_hashes.items())},
        "dropped_rounds": sync.stats.dropped_rounds,
        "merged_rounds": sync.stats.merged_rounds,
        "diverged_rounds": sync.stats.diverged_rounds,
        "uncounted": {str(r): why for r, why in sorted(sync.stats.uncounted.items())} or None,
        "momentum_pulled": sync.stats.momentum_pulled or None,
        "rejoins": sync.stats.rejoins,
        "reconnects": sync.stats.reconnects,
    }


def _overlap_record(site: _Site, cfg: RunConfig) -> dict[str, Any]:
    """Compute utilization (time in inner steps over the time from joining to the last round
    landed), stalls, and bytes per fragment."""
    assert site.loop is not None
    stats = site.loop.stats
    util = stats.compute_utilization
    return {
        "compute_utilization": round(util, 4) if util is not None else None,
        "utilization_until_last_step": round(stats.utilization_until_last_step, 4) if stats.utilization_until_last_step is not None else None,
        "stall_s": round(stats.stall_s, 4),
        "stalls": stats.stalls if site.schedule.overlapped else None,
        "fragment_bytes": site.fragment_bytes if site.schedule.fragments > 1 else None,
        "sync_mode": site.schedule.label,
    }


def _eval_due(sync: OuterSync) -> bool:
    """The coordinator asked the sites to evaluate θ after this round (every eval_every, and the last)."""
    return sync.eval_every > 0 and (sync.round % sync.eval_every == 0 or sync.finished)


def _median_times(timings: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in (timings[0] if timings else {}) if k != "round" and not k.startswith("bytes")]
    return {k: round(statistics.median(t.get(k, 0.0) for t in timings), 5) for k in keys}


def run_site(cfg: RunConfig, opts: SiteOptions, run_dir: Path, log: Callable[[str], None] = print, hooks: SiteHooks | None = None) -> dict[str, Any]:
    """Trains until the coordinator's last round; writes run_dir/workers/<site_id>.json.
    ``hooks``: the simulation's fault injection (None in a real run)."""
    torch.set_num_threads(cfg.threads)
    shard = opts.data_shard(cfg.sites)
    # A rank trains on cuda:LOCAL_RANK; a simulated one-rank site on the GPU the simulator gave it.
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", opts.gpu or 0)))
    configure_cuda(device, cfg.tf32)
    dims = init_site_group(cfg.layout_of(shard), device)  # under torchrun: one process per rank of this site
    corpus = load_corpus(cfg.data, cfg.model.context, num_shards=cfg.sites)
    # Every rank draws the site's whole batch (the same sampler) and trains on its share of it.
    sampler = ShardSampler(corpus.train, shard=shard, num_shards=cfg.sites, batch_size=cfg.data.batch_size, context=cfg.model.context, seed=cfg.seed)
    # Built on the CPU from the seed (the same weights on every device), then moved.
    layout = build_layout(dims, build_model(cfg.model, cfg.seed).to(device), parallelize=load_parallelize(cfg.model))
    if not layout.leader:
        log = _silent  # the site's leader rank speaks for it
    if cfg.compile and layout.forward_backward is None:
        layout.model.compile()  # in place: torch.compile(m) would rename every parameter "_orig_mod.…"
    # TensorBoard and /metrics, from the leader rank (docs/observability.md); a metrics port in use fails here.
    observer = SiteObserver.start(opts.site_id, cfg.tensorboard, opts.metrics, run_dir, log, cfg.security) if layout.leader else SiteObserver()
    live = _live_progress(cfg, opts, layout.leader, log)
    log = live.say  # log lines go above a progress bar
    site = _Site(cfg, opts, run_dir, log, hooks, layout, sampler, corpus, observer)
    site.live = live
    start = time.monotonic()
    try:
        with CoordinatorClient(
            opts.coordinator_address(), connect_timeout_s=opts.connect_timeout_s, security=cfg.security, site_id=opts.site_id, streams=cfg.sync.streams
        ) as real_client:
            client = hooks.wrap(real_client) if hooks else real_client
            # The run's settings are the coordinator's: this site states what its config set explicitly.
            options = SyncOptions(own=cfg.settings, stated=opts.stated, chunk_bytes=cfg.chunk_bytes)
            sync = OuterSync(
                layout, client, opts.site_id, options, log=log, before_push=hooks.before_push if hooks else None, on_diverged=site.trainer.reset_state
            )
            try:
                site_hash = site.train(sync, shard)
            finally:
                sync.close()
    finally:
        observer.close()
        live.close()
    per_rank = layout.gather_objects({"bytes_up": sync.stats.bytes_up, "bytes_down": sync.stats.bytes_down, "sync": _median_times(sync.stats.timings)})
    close_site_group()
    if not layout.leader:
        return {}
    result = WorkerRecord(
        site_id=opts.site_id,
        shard=shard,
        tokens=site.tokens,
        inner_steps=site.trainer.steps_done,
        layout=dims.name,
        device=str(device),
        **_traffic(per_rank, layout.world),
        inner_step_s_median=round(statistics.median(site.loop.stats.step_s), 5) if site.loop and site.loop.stats.step_s else None,
        steps_per_round={str(r): n for r, n in sorted(site.loop.steps_per_round.items())} if site.loop else {},
        **_sync_record(sync),
        incarnation=opts.incarnation,
        restored=dataclasses.asdict(site.restored) if site.restored is not None else None,
        **_overlap_record(site, cfg),
        global_sha256=site_hash,
        wall_s=round(time.monotonic() - start, 3),
        peak_rss_mb=peak_rss_mb(),
    )
    records.write(RunDir(run_dir).worker(opts.site_id), result)
    return records.to_dict(result)


def _live_progress(cfg: RunConfig, opts: SiteOptions, leader: bool, log: Callable[[str], None]) -> LiveProgress:
    """The site's own progress bar (or plain lines) of its inner steps, from its leader rank."""
    schedule = cfg.schedule
    tracker = ProgressTracker(rounds=cfg.sync_rounds, sites=1, round_steps=schedule.round_steps, train_rounds=schedule.train_rounds, early=schedule.early)
    return LiveProgress(opts.progress if leader else OFF, log, tracker, label=f"site {opts.site_id}")


class _Site:
    """One site process's rounds: inner phases, outer syncs, its checkpoints and evaluations."""

    def __init__(
        self, cfg: RunConfig, opts: SiteOptions, run_dir: Path, log: Callable[[str], None], hooks: SiteHooks | None, layout: Any, sampler: ShardSampler, corpus: Any,
        observer: SiteObserver | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.opts, self.log, self.hooks = cfg, opts, log, hooks
        self.observer = observer or SiteObserver()  # TensorBoard and /metrics (each may be off)
        self.layout, self.sampler, self.corpus = layout, sampler, corpus
        self.trainer = InnerTrainer(layout.model, cfg.inner, total_steps=cfg.total_steps, layout=layout)
        self.heldout: list | None = None  # the site's held-out batches, made the first time it evaluates
        self.tokens = 0  # tokens of rounds this site synced
        # Every token this process trains, counted as it goes (goodput: the simulator compares it
        # with the tokens that made it into committed rounds); rewritten each step, so a killed
        # site's count is at most one step behind.
        self.progress = RunDir(run_dir).progress(opts.site_id, opts.incarnation)
        self.trained = 0
        self.live: LiveProgress | None = None  # the site's progress on the terminal (diloco-site)
        self.schedule = cfg.schedule  # when this site pushes and merges: its own until it joins, then the run's
        self.loop: RoundLoop | None = None
        self.checkpointer: SiteCheckpointer | None = None
        self.restored: Restored | None = None  # its own checkpoint, restored at start
        self.fragment_bytes: dict[str, dict[str, int]] = {}  # fragment -> payload bytes up and down

    def train(self, sync: OuterSync, shard: int) -> str:
        """Joins, trains every round, leaves; returns the hash of the site's whole θ."""
        cfg, opts, log = self.cfg, self.opts, self.log
        info = sync.join()
        # A site that joins late (or again, after a crash) starts its lr schedule and its
        # data where the run is; its inner optimizer state starts fresh.
        # The run's settings, from the coordinator: its rounds and schedule are this site's.
        self.schedule = sync.settings.schedule
        self.trainer.total_steps = sync.settings.total_steps
        self.trainer.steps_done = self.schedule.steps_before(sync.round)
        log(
            f"site {opts.site_id} joined run {info.run_id} at round {sync.round} (shard {shard} of {cfg.sites}, incarnation {opts.incarnation}; sync {self.schedule.label})"
        )
        # Site checkpoints hold one process's optimizer state: one-rank sites only, for now.
        one_rank = self.layout.world == 1
        self.checkpointer = (
            SiteCheckpointer(Path(opts.checkpoint_dir), info.run_id, self.trainer, self.sampler, log) if opts.checkpoint_dir and one_rank else None
        )
        self.restored = _restore(self.checkpointer, sync, opts.site_id, log)
        if self.restored is None or not self.restored.exact:
            self.sampler.skip(self.schedule.steps_before(sync.round))  # the data goes on where the run is
        self.loop = RoundLoop(
            sync,
            self.schedule,
            self._step,
            self.sampler.tokens_per_batch,
            lambda p, d: self._after_round(sync, p, d),
            mean=self.layout.mean,
        )
        self.observer.watch(sync, self.loop)
        try:
            self.loop.run()
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()  # the last checkpoint on disk
        # The hash of the whole θ: of this rank's copy, or (sharded sites) of the whole
        # tensors gathered from the ranks once, at the end, only to verify it.
        site_hash = sync.global_sha256() if one_rank else params_sha256(self.layout.full_state())
        self.layout.barrier()
        if self.layout.leader:
            sync.leave(site_hash)
        return site_hash

    def _step(self, round: int, step: int) -> float:
        """One inner step, counted as it goes."""
        t0, at = time.monotonic(), self.trainer.steps_done
        loss = self.trainer.step(*self.layout.batch(*self.sampler.next_batch()))
        self.trained += self.sampler.tokens_per_batch
        self.observer.step(at, loss, self.trainer.optimizer.param_groups[0]["lr"], time.monotonic() - t0, self.sampler.tokens_per_batch)
        if self.layout.leader:
            at = SiteStep(round, step + 1, self.schedule.steps_of(round))
            write_json_atomic(self.progress, records.to_dict(ProgressRecord(tokens=self.trained, round=at.round, step=at.step, steps=at.steps)), fsync=False)
            if self.live is not None:
                self.live.update(round, {self.opts.site_id: at}, force=at.step >= at.steps)
        if self.hooks:
            self.hooks.after_step(round, step, self.schedule.steps_of(round), time.monotonic() - t0)
            if self.hooks.diverges(round, step, self.schedule.steps_of(round)):
                with torch.no_grad():  # the first parameter turns NaN; the next steps spread it everywhere
                    next(self.layout.model.parameters()).mul_(math.nan)
        return loss

    def _after_round(self, sync: OuterSync, pending: PendingRound, digest: str) -> None:
        """What follows a landed round: the tokens, the lr schedule after a catch-up, the site's
        checkpoint, the log line and an evaluation when due."""
        opts = self.opts
        self.tokens += pending.header.tokens
        fragments = self.schedule.fragments
        fragment = str(pending.header.round % fragments)
        counts = self.fragment_bytes.setdefault(fragment, {"up": 0, "down": 0})
        counts["up"] += int(pending.times.get("bytes_up", 0))
        counts["down"] += int(pending.times.get("bytes_down", 0))
        # The lr schedule's place: the open round's, plus the steps trained since the push (with
        # overlap, τ of them; under eager/delayed a round lands after the next phase: all of
        # it). After a dropped round the site continues at the open round's place.
        self.trainer.steps_done = self.schedule.steps_before(sync.round) + self.loop.phase_steps
        # With fragments, after a whole cycle of them: a checkpoint (the inner optimizer's state,
        # the residual) per fragment round cost a 2-core site more time than the stalls it hides.
        if self.checkpointer and not sync.finished and sync.round % fragments == 0:
            self.checkpointer.save(round=sync.round, global_sha256=digest, residual=sync.residual, tokens=self.tokens)
        self.observer.landed(pending.header.round, pending.times)
        last = self.loop.last_loss.get(pending.header.round)
        loss = f"train_loss={last:.4f} " if last is not None else ""
        self.log(f"site {opts.site_id} round {pending.header.round} done: {loss}global {digest[:12]}")
        if _eval_due(sync) and self.layout.forward_backward is None:
            self.evaluate(sync)

    def evaluate(self, sync: OuterSync) -> None:
        """Evaluation by sites: the global θ the model now holds, on this site's own held-out data."""
        cfg = self.cfg
        if self.heldout is None:
            self.heldout = eval_batches(self.corpus.heldout, context=cfg.model.context, batch_size=cfg.data.batch_size, num_batches=cfg.data.eval_batches)
        if self.schedule.label == "blocking":
            loss, count = evaluate_loss(self.layout.model, self.heldout)
        else:
            with sync.holding_global():  # the model is mid-phase (or merged): evaluate θ itself
                loss, count = evaluate_loss(self.layout.model, self.heldout)
        sync.report_eval(sync.round - 1, loss, count)
