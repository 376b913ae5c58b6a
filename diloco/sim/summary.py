"""summary.json of a simulated run, from what its processes wrote: the global and worker
records and the metrics lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.app import records
from diloco.app.config import RunConfig
from diloco.app.records import GlobalRecord, MetricsLine, ProgressRecord, Summary, WorkerRecord
from diloco.run_dir import RunDir
from diloco.sim.faults import read_fired
from diloco.sim.links import WanPlan


def summarize(cfg: RunConfig, run_dir: Path, wall_s: float, wan: WanPlan | None = None) -> dict[str, Any]:
    rd = RunDir(run_dir)
    g = records.read(rd.global_record, GlobalRecord)
    workers = {p.stem: records.read(p, WorkerRecord) for p in sorted(rd.workers_dir.glob("*.json"))}
    metrics = records.read_metrics(rd.metrics)
    site_hashes = {sid: w.global_sha256 for sid, w in sorted(workers.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0])}
    # Goodput: tokens in committed (not rejected) rounds over every token any site trained,
    # counting the work of killed processes and dropped rounds (progress/<site>.<incarnation>).
    trained = sum(records.read(p, ProgressRecord).tokens for p in rd.progress_dir.glob("*.json"))
    committed = sum(m.tokens + sum(p["tokens"] for p in m.merged) for m in metrics if not m.rejected)
    summary = Summary(
        mode=cfg.mode,
        sites=cfg.workers,
        sync_every=cfg.sync.every,
        rounds=cfg.rounds,
        rounds_committed=g.rounds_committed,
        rounds_rejected=sum(1 for m in metrics if m.rejected),
        refused_pushes=refused_pushes(metrics),
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
        **overlap_summary(cfg, workers),
        wan=wan.to_dict() if wan is not None else None,
    )
    return records.to_dict(summary)


def with_mean(per_site: dict[str, float]) -> dict[str, float]:
    return {**per_site, "run": round(sum(per_site.values()) / len(per_site), 4)} if per_site else {}


def overlap_summary(cfg: RunConfig, workers: dict[str, WorkerRecord]) -> dict[str, Any]:
    """Per site and for the run: compute utilization, stalls, bytes per fragment."""
    if cfg.mode != "diloco":
        return {}
    util = with_mean({sid: w.compute_utilization for sid, w in workers.items() if w.compute_utilization is not None})
    until = with_mean({sid: w.utilization_until_last_step for sid, w in workers.items() if w.utilization_until_last_step is not None})
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


def refused_pushes(metrics: list[MetricsLine]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in metrics:
        for r in m.refused or []:
            counts[r["site"]] = counts.get(r["site"], 0) + 1
    return dict(sorted(counts.items()))
