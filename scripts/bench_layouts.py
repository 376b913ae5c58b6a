"""Inner layouts, measured: one site of each layout (a torchrun group on this machine)
training model=small against a coordinator, through diloco-sim.

Per layout: ranks; the median inner step time and the site's tokens per second (the site's
batch, data.batch_size × context tokens, over the step time); bytes each rank pushed and
pulled per round (fp32; pulled = all it pulled, θ at join included, over rounds + 1, since
the θ pull at join is the size of one update pull); and the median seconds per round of each
part of the outer sync on rank 0: compute Δ, encode, push (transfer up), wait (for the round
to close), pull (transfer down and decode), apply (θ += u, load into the model).

With --quality, also the final eval bpb of a run whose sites have different layouts
(--mixed, default tp2,fsdp2,pp2,single) next to the same run with every site single (tiny
model, H=50, 10 rounds, seed 0: the same tokens per site).

    .venv/bin/python scripts/bench_layouts.py --out runs/bench_layouts/readme
    .venv/bin/python scripts/bench_layouts.py --quality --layouts "" --out runs/bench_layouts/quality
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from diloco.app.config import run_config_from_dict
from diloco.io import write_json_atomic
from diloco.sim.launcher import run_simulation
from diloco.site.layouts.config import LAYOUT_RANKS

SYNC_PARTS = ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")


def _run(name: str, cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    run_dir = out / name
    done = run_dir / "summary.json"
    if done.exists():
        return json.loads(done.read_text())
    print(f"== {name}", flush=True)
    return run_simulation(run_config_from_dict(cfg), run_dir, progress=None, timeout_s=3600)


def measure_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = {
        "sites": 1, "model": {"name": args.model}, "sync": {"every": args.sync_every}, "rounds": args.rounds, "eval_every": args.rounds,
        "data": {"batch_size": args.batch_size}, "layout": {"name": layout}, "seed": args.seed,
    }  # fmt: skip
    summary = _run(layout, cfg, args.out)
    worker = json.loads((args.out / layout / "workers" / "0.json").read_text())
    step = worker["inner_step_s_median"]
    tokens_per_step = args.batch_size * 128
    return {
        "ranks": worker["ranks"],
        "inner_step_s": step,
        "tokens_per_s": round(tokens_per_step / step, 1),
        "pushed_per_rank_per_round": [b // args.rounds for b in worker["bytes_up_per_rank"]],
        "pulled_per_rank_per_round": [b // (args.rounds + 1) for b in worker["bytes_down_per_rank"]],
        "sync_s_rank0": worker["sync_s_median_per_rank"][0],
        "hashes_equal": summary["hashes_equal"],
        "params": summary["params"],
    }


def measure_quality(args: argparse.Namespace) -> dict[str, Any]:
    mixed = [s.strip() for s in args.mixed.split(",")]
    base = {"sites": len(mixed), "rounds": 10, "eval_every": 10, "seed": args.seed, "sync": {"every": 50}}
    out = {}
    for name, cfg in (("all_single", base), ("mixed", {**base, "site_layouts": mixed})):
        s = _run(name, cfg, args.out)
        out[name] = {"final_eval_bpb": s["final_eval_bpb"], "hashes_equal": s["hashes_equal"], "tokens": s["tokens"], "wall_s": s["wall_s"]}
    out["mixed"]["layouts"] = mixed
    out["mixed_vs_single_pct"] = round(100 * (out["mixed"]["final_eval_bpb"] / out["all_single"]["final_eval_bpb"] - 1), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_layouts.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUT_RANKS), help="comma-separated; empty: none")
    p.add_argument("--model", default="small")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", action="store_true")
    p.add_argument("--mixed", default="tp2,fsdp2,pp2,single")
    p.add_argument("--out", type=Path, default=Path("runs/bench_layouts/latest"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"layouts": {}}
    for layout in [s.strip() for s in args.layouts.split(",") if s.strip()]:
        if layout not in LAYOUT_RANKS:
            p.error(f"unknown layout {layout!r}; known: {', '.join(LAYOUT_RANKS)}")
        results["layouts"][layout] = measure_layout(layout, args)
    if args.quality:
        results["quality"] = measure_quality(args)
    write_json_atomic(args.out / "results.json", results)
    print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    rows = results["layouts"]
    if rows:
        print(f"{'layout':<10} ranks  step s  tokens/s  pushed/rank/round (B)     pulled/rank/round (B)     " + " ".join(f"{k[:-2]:>7}" for k in SYNC_PARTS))
        for name, r in rows.items():
            pushed = ",".join(str(b) for b in r["pushed_per_rank_per_round"])
            pulled = ",".join(str(b) for b in r["pulled_per_rank_per_round"])
            sync = " ".join(f"{r['sync_s_rank0'].get(k, 0):7.3f}" for k in SYNC_PARTS)
            print(f"{name:<10} {r['ranks']:5d} {r['inner_step_s']:7.3f} {r['tokens_per_s']:9.0f}  {pushed:<25} {pulled:<25} {sync}")
    q = results.get("quality")
    if q:
        print(
            f"mixed {','.join(q['mixed']['layouts'])}: final eval bpb {q['mixed']['final_eval_bpb']:.4f}; all single: {q['all_single']['final_eval_bpb']:.4f} ({q['mixed_vs_single_pct']:+.3f}%)"
        )


if __name__ == "__main__":
    sys.exit(main())
