"""Hiding the network, measured: the same DiLoCo run (4 sites, equal tokens) through emulated
links, once per way of syncing (blocking, streaming fragments without and with overlap,
eager, delayed), each with its compute utilization, stalls and final eval bpb, next to what
diloco-plan predicts from the run's own measured step time and a loopback sync's cost.

    .venv/bin/python scripts/bench_overlap.py --bandwidth-mbit 10 --rtt-ms 100 --out runs/overlap_10.json
    .venv/bin/python scripts/bench_overlap.py --bandwidth-mbit 100 --rtt-ms 50 --out runs/overlap_100.json

Every run is a real simulation (separate processes, TLS, the WAN emulator process shaping the
byte streams between each site and the coordinator). Read the figures from an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco.app.config import run_config_from_dict
from diloco.plan import NO_COORDINATOR_CPU, Plan, predict, run_utilization
from diloco.sim.launcher import run_simulation
from diloco.sim.links import wan_plan

MODES: dict[str, dict[str, Any]] = {
    "blocking": {},
    # sync.preset=hide_link: diloco-plan's model chooses for the emulated link (diloco/app/preset.py).
    "preset hide_link": {"sync": {"preset": "hide_link"}},
    "streaming F=5 τ=0": {"sync": {"fragments": 5}},  # H=50: F must divide H (4 does not)
    "streaming F=5 τ=5": {"sync": {"fragments": 5, "overlap": 5}},
    "streaming F=5 τ=5 delta": {"sync": {"fragments": 5, "overlap": 5, "merge": "delta"}},
    "streaming F=5 τ=1 delta": {"sync": {"fragments": 5, "overlap": 1, "merge": "delta"}},
    "streaming F=5 τ=2 delta": {"sync": {"fragments": 5, "overlap": 2, "merge": "delta"}},
    "streaming F=5 τ=4 delta": {"sync": {"fragments": 5, "overlap": 4, "merge": "delta"}},
    "streaming F=5 τ=5 delta zstd": {"codec": "int8+zstd", "sync": {"fragments": 5, "overlap": 5, "merge": "delta"}},  # the same bits, entropy-coded
    "streaming F=5 τ=5 ahead zstd": {"codec": "int8+zstd", "sync": {"fragments": 5, "overlap": 5, "merge": "ahead"}},
    "streaming F=5 τ=5 ahead": {"sync": {"fragments": 5, "overlap": 5, "merge": "ahead"}},  # w = 0 (AHEAD_WEIGHT)
    # A 4-bit downlink (with the coordinator's error feedback): half the pull's bytes.
    "streaming F=5 τ=5 ahead int4 down": {"codec_down": "int4", "sync": {"fragments": 5, "overlap": 5, "merge": "ahead"}},
    # Fragments of equal sizes (8 layers in 5 strided fragments: three of 1.58M elements, two of 0.8M).
    "streaming F=5 τ=5 ahead balanced": {"sync": {"fragments": 5, "overlap": 5, "merge": "ahead", "split": "balanced"}},
    "streaming F=5 τ=5 ahead int4 down balanced": {"codec_down": "int4", "sync": {"fragments": 5, "overlap": 5, "merge": "ahead", "split": "balanced"}},
    "streaming F=5 τ=0 balanced": {"sync": {"fragments": 5, "split": "balanced"}},
    "streaming F=5 τ=5 ahead int4 down balanced freeze": {
        "codec_down": "int4",
        "sync": {"fragments": 5, "overlap": 5, "merge": "ahead", "split": "balanced", "end": "freeze"},
    },
    "streaming F=5 τ=5 delta int4 down balanced": {"codec_down": "int4", "sync": {"fragments": 5, "overlap": 5, "merge": "delta", "split": "balanced"}},
    "streaming F=5 τ=5 ahead zstd int4 down": {"codec": "int8+zstd", "codec_down": "int4+zstd", "sync": {"fragments": 5, "overlap": 5, "merge": "ahead"}},
    "streaming F=5 τ=5 ahead w=0.5": {"sync": {"fragments": 5, "overlap": 5, "merge": "ahead", "lookahead_weight": 0.5}},
    "streaming F=5 τ=5 ahead w=0": {"sync": {"fragments": 5, "overlap": 5, "merge": "ahead", "lookahead_weight": 0.0}},
    "streaming F=5 τ=4 ahead": {"sync": {"fragments": 5, "overlap": 4, "merge": "ahead"}},
    "streaming F=5 τ=6 delta": {"sync": {"fragments": 5, "overlap": 6, "merge": "delta"}},
    "streaming F=5 τ=6 ahead": {"sync": {"fragments": 5, "overlap": 6, "merge": "ahead"}},
    "streaming F=5 τ=7 ahead": {"sync": {"fragments": 5, "overlap": 7, "merge": "ahead"}},
    "streaming F=5 τ=7 ahead freeze": {"sync": {"fragments": 5, "overlap": 7, "merge": "ahead", "end": "freeze"}},
    "streaming F=5 τ=6 ahead freeze": {"sync": {"fragments": 5, "overlap": 6, "merge": "ahead", "end": "freeze"}},
    "streaming F=5 τ=7 delta": {"sync": {"fragments": 5, "overlap": 7, "merge": "delta"}},
    "streaming F=2 τ=10 delta": {"sync": {"fragments": 2, "overlap": 10, "merge": "delta"}},
    "overlap F=1 τ=25 delta": {"sync": {"overlap": 25, "merge": "delta"}},
    "streaming F=5 τ=1": {"sync": {"fragments": 5, "overlap": 1}},
    "eager": {"sync": {"mode": "eager"}},
    "eager w=1": {"sync": {"mode": "eager", "lookahead_weight": 1.0}},
    "delayed": {"sync": {"mode": "delayed"}},
}


def _workers(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("*.json"))]


def _global(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "global.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_one(base: dict[str, Any], extra: dict[str, Any], wan: Any, run_dir: Path, timeout_s: float = 3600.0) -> dict[str, Any]:
    cfg = run_config_from_dict({**base, **extra, "sync": {**base.get("sync", {}), **extra.get("sync", {})}})
    t = time.monotonic()
    s = run_simulation(cfg, run_dir, progress=None, wan=wan, timeout_s=timeout_s)
    # What the run resolved to (sync.preset chooses its keys when it starts): config.json.
    cfg = run_config_from_dict(json.loads((run_dir / "config.json").read_text()))
    workers = _workers(run_dir)
    step_s = statistics.median(w["inner_step_s_median"] for w in workers)
    pushes = cfg.sync_rounds * cfg.sites
    return {
        "config": extra,
        "chosen": {
            "sync": {k: v for k, v in dataclasses.asdict(cfg.sync).items() if k in ("fragments", "overlap", "merge", "split", "end", "step_s")},
            "codec": cfg.codec.name,
            "codec_down": cfg.downlink_codec.name,
        }
        if cfg.sync.preset != "none"
        else None,
        "wall_s": round(time.monotonic() - t, 1),
        "final_eval_bpb": s["final_eval_bpb"],
        "hashes_equal": s["hashes_equal"],
        "compute_utilization": s["compute_utilization"],
        "utilization_until_last_step": s.get("utilization_until_last_step"),
        "stall_s": s["stall_s"],
        "step_s": step_s,
        "bytes_up_per_push": s["bytes_up"] / pushes,
        "bytes_down_per_pull": sum(sum(b["down"] for b in (w.get("fragment_bytes") or {}).values()) for w in workers) / pushes
        if cfg.sync.fragments > 1
        else None,
        "sync_s_median": [w["sync_s_median_per_rank"][0] for w in workers],
        "commit_s_median": _global(run_dir).get("commit_s_median"),
        "params": s["params"],
    }


def straggle_of(blocking: dict[str, Any], sync_every: int) -> tuple[float, float]:
    """The sites' straggle as a blocking run measured it: the sites' mean wait for the round to
    close (median per site), over an inner phase (diloco-plan's ``straggle``) and in seconds
    per sync (its ``straggle_s``)."""
    wait = statistics.mean(t["wait_s"] for t in blocking["sync_s_median"])
    return wait / (sync_every * blocking["step_s"]), wait


def plan_for(
    r: dict[str, Any],
    base: dict[str, Any],
    extra: dict[str, Any],
    mbit: float | None,
    rtt_ms: float,
    overhead_s: float,
    straggle: float = 0.0,
    straggle_s: float = 0.0,
) -> dict[str, Any]:
    """diloco-plan's prediction for the run, from its own measured step time and payload bits."""
    sync = extra.get("sync", {})
    bits = 8 * r["bytes_up_per_push"] * sync.get("fragments", 1) / r["params"]
    down_bits = 8 * r["bytes_down_per_pull"] * sync.get("fragments", 1) / r["params"] if r.get("bytes_down_per_pull") else None
    plan = Plan(
        params=r["params"], step_s=r["step_s"], sync_every=base["sync"]["every"], bits=bits, down_bits=down_bits, fragments=sync.get("fragments", 1),
        overlap_steps=sync.get("overlap", 0), outer_mode=sync.get("mode", "blocking"), sites=base["sites"],
        bandwidth_gbit=(mbit or 1e6) / 1000, coordinator_bandwidth_gbit=1e6, rtt_ms=rtt_ms, overhead_s=overhead_s, straggle=straggle, straggle_s=straggle_s,
        **NO_COORDINATOR_CPU,  # overhead_s, measured, holds the coordinator's cost already
    )  # fmt: skip
    p = predict(plan)
    run = run_utilization(plan, base["rounds"], flush=sync.get("end", "flush") == "flush")
    until = run_utilization(plan, base["rounds"], tail=False)
    return {
        "utilization": round(p.utilization, 4),
        "run_utilization": round(run, 4),
        "utilization_until_last_step": round(until, 4),
        "round_s": round(p.round_s, 3),
        "sync_s": round(p.sync_s, 3),
        "bits": round(bits, 3),
    }


def replan(files: list[Path], straggle_from: Path | None) -> int:
    """Each measured row beside diloco-plan's prediction without the sites' straggle, with it as
    a fraction of the steps between syncs (``straggle``) and in seconds per sync (``straggle_s``)."""
    source = json.loads(straggle_from.read_text()) if straggle_from else None
    for path in files:
        results = json.loads(path.read_text())
        a = results["args"]
        base = {"sites": a["sites"], "rounds": a["rounds"], "sync": {"every": a["sync_every"]}}
        overhead = results.get("overhead_s") or results.get("loopback_blocking", {}).get("overhead_s")
        blocking = (source or results)["runs"]["blocking"]
        straggle, straggle_s = straggle_of(blocking, a["sync_every"])
        print(
            f"{path}: {a['bandwidth_mbit']:g} Mbit/s, {a['rtt_ms']:g} ms, {a['rounds']} rounds; overhead {overhead} s; straggle {straggle:.4f} = {straggle_s:.3f} s per sync (from {straggle_from or path}'s blocking run)"
        )
        for name, r in results["runs"].items():
            plain = plan_for(r, base, r["config"], a["bandwidth_mbit"], a["rtt_ms"], overhead)
            frac = plan_for(r, base, r["config"], a["bandwidth_mbit"], a["rtt_ms"], overhead, straggle=straggle)
            secs = plan_for(r, base, r["config"], a["bandwidth_mbit"], a["rtt_ms"], overhead, straggle_s=straggle_s)
            u, t = r["compute_utilization"]["run"], r["utilization_until_last_step"]["run"]
            print(
                f"  {name:<24} measured {u:.3f} / {t:.3f}   planned {plain['run_utilization']:.3f} / {plain['utilization_until_last_step']:.3f}"
                f"   straggle {frac['run_utilization']:.3f} / {frac['utilization_until_last_step']:.3f}"
                f" ({100 * (frac['run_utilization'] - u):+.1f} / {100 * (frac['utilization_until_last_step'] - t):+.1f} pts)"
                f"   straggle_s {secs['run_utilization']:.3f} / {secs['utilization_until_last_step']:.3f}"
                f" ({100 * (secs['run_utilization'] - u):+.1f} / {100 * (secs['utilization_until_last_step'] - t):+.1f} pts)"
            )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--bandwidth-mbit", type=float, default=10.0)
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--overhead-s", type=float, help="the sync's fixed cost for the planner; default: measured by a loopback blocking run first")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="another run key for every mode, dotted (outer.lr=0.5); numbers parsed as JSON"
    )
    ap.add_argument("--loopback", action="store_true", help="no emulated link (the bpb figures do not depend on the link: every mode is deterministic)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout-s", type=float, default=7200.0, help="each run's limit (sim.timeout_s): 30-round runs sharing the machine take over an hour")
    ap.add_argument(
        "--replan",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: print the measured rows of these result files next to diloco-plan's predictions, with the sites' straggle from --straggle-from",
    )
    ap.add_argument(
        "--straggle-from", type=Path, metavar="JSON", help="with --replan: the result file whose blocking run gives the straggle (default: each file's own)"
    )
    args = ap.parse_args()
    if args.replan:
        return replan(args.replan, args.straggle_from)
    base = {"sites": args.sites, "sync": {"every": args.sync_every}, "rounds": args.rounds, "codec": args.codec, "model": {"name": args.model},
            "data": {"batch_size": args.batch_size}, "eval_every": 1000}  # fmt: skip
    for item in args.set:
        key, _, value = item.partition("=")
        *path, leaf = key.split(".")
        node = base
        for part in path:
            node = node.setdefault(part, {})
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError:
            node[leaf] = value
    link = {"bandwidth_mbit": args.bandwidth_mbit, "rtt_ms": args.rtt_ms}
    wan = None if args.loopback else wan_plan(link, None, args.sites)
    results: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # The sync's fixed cost (encode, commit, decode) on loopback, for the planner.
        if args.overhead_s is None:
            ref = run_one(base, {}, None, Path(tmp) / "loopback", args.timeout_s)
            overhead = statistics.median(sum(v for k, v in t.items() if k != "wait_s") for t in ref["sync_s_median"])
            results["loopback_blocking"] = ref | {"overhead_s": round(overhead, 4)}
            print(
                f"loopback blocking: utilization {ref['compute_utilization']['run']:.3f}, step {ref['step_s']:.3f} s, sync overhead {overhead:.3f} s, bpb {ref['final_eval_bpb']:.4f}",
                flush=True,
            )
        else:
            overhead = args.overhead_s
            results["overhead_s"] = overhead
        for name in args.modes.split(","):
            extra = MODES[name]
            r = run_one(base, extra, wan, Path(tmp) / name.replace(" ", "_"), args.timeout_s)
            r["predicted"] = plan_for(r, base, extra, args.bandwidth_mbit, args.rtt_ms, overhead)
            results["runs"][name] = r
            u = r["compute_utilization"]["run"]
            t = (r["utilization_until_last_step"] or {}).get("run", float("nan"))
            pr = r["predicted"]
            print(
                f"{name:<20} utilization {u:.3f} (planned {pr['run_utilization']:.3f}), until the last step {t:.3f} (planned {pr['utilization_until_last_step']:.3f}), steady planned {pr['utilization']:.3f}  stall {statistics.median(r['stall_s'].values()):7.1f} s  bpb {r['final_eval_bpb']:.4f}  wall {r['wall_s']:.0f} s  hashes_equal {r['hashes_equal']}",
                flush=True,
            )
            if args.out:  # after every run: a run cut short keeps what finished
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
    blocking = results["runs"].get("blocking")
    if blocking:
        for r in results["runs"].values():
            r["bpb_vs_blocking"] = round(r["final_eval_bpb"] / blocking["final_eval_bpb"] - 1, 4)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
