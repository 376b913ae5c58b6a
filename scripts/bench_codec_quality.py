"""Quality and communication per codec: final held-out eval bpb against ``codec=fp32``.

For every seed and every variant it runs the DiLoCo simulation (4 sites, H=50, 10 rounds,
tiny model by default: the same tokens for every variant) and, once, ``mode=ddp`` with the
first seed, whose all-reduced fp32 gradient bytes are the denominator of the reduction.
Variants are a codec name or a recipe (``conf/recipe``: ``sparseloco``, ``sparse``), optionally with
``:noef`` (error_feedback=false), e.g. ``topk2bit:noef`` or ``sparseloco:noef``. Runs go seed by seed so a cut-short benchmark still compares every
variant on the seeds it finished. Results go to OUT/results.json after every run; the
table at the end gives per variant the median bpb, its % change against fp32 (per-seed
differences, median), bytes_up per round against the formula params x bits / 8 + scales
(``encoded_size`` of the codec, chunk by chunk, times sites) and the reduction against DDP.

    .venv/bin/python scripts/bench_codec_quality.py --out runs/bench_codec_quality/readme

``--summarize`` re-prints the table of an existing OUT without running anything; a run whose
summary.json exists in OUT is read back instead of run again (resume after an interruption).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quality import apply_override, parse_override  # noqa: E402

from diloco.app.config import RunConfig, run_config_defaults, run_config_from_dict, run_config_to_dict  # noqa: E402
from diloco.io import read_jsonl, write_json_atomic  # noqa: E402
from diloco.model import build_model  # noqa: E402
from diloco.sim.launcher import SimError, SimStopped, run_simulation  # noqa: E402
from diloco.wire.chunks import encoded_bytes  # noqa: E402

DEFAULT_VARIANTS = "fp32,int8,int4,e3m0,topk2bit,topk2bit:noef,sparseloco,sparseloco:noef,sparse,sparse:noef"
RECIPES = {p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "recipe").glob("*.yaml")}


def recipe_config(name: str) -> dict[str, Any]:
    """The run config that ``recipe=NAME`` gives on the command line, composed by hydra."""
    from hydra import compose, initialize_config_module

    from diloco.cli.common import run_config

    with initialize_config_module("diloco.conf", version_base=None):
        return run_config_to_dict(run_config(compose("run", overrides=[f"recipe={name}"]), sections=()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_codec_quality.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated CODEC[:noef] (default {DEFAULT_VARIANTS})")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--model", default="tiny")
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP run (the reduction is then computed from the formula 4 x params x ranks x steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run (as bench_quality.py)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_codec_quality/latest"))
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--summarize", action="store_true", help="only print the table of OUT/results.json")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args


def build(args: argparse.Namespace, variant: str, seed: int, mode: str = "diloco") -> RunConfig:
    name, _, flag = variant.partition(":")
    if flag not in ("", "noef"):
        raise SystemExit(f"variant {variant!r}: the only flag is ':noef'")
    d = recipe_config(name) if name in RECIPES else run_config_defaults()
    d.update(mode=mode, sites=args.sites, rounds=args.rounds, seed=seed)
    d.setdefault("sync", {})["every"] = args.sync_every
    d["model"] = {"name": args.model}
    if name not in RECIPES:
        d["codec"] = name
    d["error_feedback"] = flag != "noef"
    for text in args.overrides:
        path, value = parse_override(text)
        apply_override(d, path, value)
    return run_config_from_dict(d)


def formula_bytes_per_site(cfg: RunConfig) -> int:
    """params x bits / 8 + headers and scales: the codec's encoded_size over the chunks a site sends."""
    numels = [p.numel() for p in build_model(cfg.model, cfg.seed).parameters()]
    return encoded_bytes(numels, codec=cfg.codec.build(), chunk_bytes=cfg.chunk_bytes)


def aggregate(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    ddp = next((r for r in ok if r["variant"] == "ddp"), None)
    by: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in variants}
    for r in ok:
        if r["variant"] != "ddp":
            by.setdefault(r["variant"], {})[r["seed"]] = r
    ref = by.get("fp32", {})
    rows = {}
    for v in variants:
        rs = by.get(v, {})
        if not rs:
            continue
        bpb = {s: r["final_eval_bpb"] for s, r in sorted(rs.items())}
        pct = {s: 100 * (b - ref[s]["final_eval_bpb"]) / ref[s]["final_eval_bpb"] for s, b in bpb.items() if s in ref}
        any_run = next(iter(rs.values()))
        per_round = sorted({m["bytes_up"] for r in rs.values() for m in read_jsonl(Path(r["run_dir"]) / "metrics.jsonl")})
        up_total = any_run["bytes_up"]
        ddp_bytes = ddp["bytes_up"] if ddp else 4 * any_run["params"] * any_run["sites"] * any_run["sync_every"] * any_run["rounds"]
        rows[v] = {
            "seeds": sorted(rs),
            "final_eval_bpb": {str(s): b for s, b in bpb.items()},
            "bpb_median": statistics.median(bpb.values()),
            "pct_vs_fp32": {str(s): p for s, p in pct.items()},
            "pct_vs_fp32_median": statistics.median(pct.values()) if pct else None,
            "bytes_up_per_round": per_round,
            "formula_bytes_per_round": any_run["formula_bytes_per_round"],
            "bytes_vs_formula": per_round[-1] / any_run["formula_bytes_per_round"],
            "reduction_vs_ddp": ddp_bytes / up_total,
            "ddp_bytes_measured": ddp is not None,
            "hashes_equal_all": all(r["hashes_equal"] for r in rs.values()),
        }
    return {"variants": rows, "ddp": {k: ddp[k] for k in ("final_eval_bpb", "bytes_up", "rounds", "sync_every")} if ddp else None}


def print_table(agg: dict[str, Any], sync_every: int) -> None:
    print("=" * 118)
    print(
        f"{'variant':<15} {'bpb median':>10} {'vs fp32 (median, per seed)':<38} {'bytes_up/round':>15} {'formula':>11} {'ratio':>6} {'vs ddp':>8} {'target':>7}"
    )
    for v, r in agg["variants"].items():
        per_seed = " ".join(f"{s}:{p:+.2f}%" for s, p in r["pct_vs_fp32"].items())
        med = "-" if r["pct_vs_fp32_median"] is None else f"{r['pct_vs_fp32_median']:+.2f}%"
        up = r["bytes_up_per_round"]
        up_s = str(up[0]) if len(up) == 1 else f"{up[0]}..{up[-1]}"
        ratio_fp32 = agg["variants"].get("fp32", {}).get("formula_bytes_per_round")
        target = f"{0.95 * sync_every * ratio_fp32 / r['formula_bytes_per_round']:.0f}x" if ratio_fp32 else "-"
        print(
            f"{v:<15} {r['bpb_median']:>10.4f} {med:>8} {per_seed:<29} {up_s:>15} {r['formula_bytes_per_round']:>11} "
            f"{r['bytes_vs_formula']:>6.3f} {r['reduction_vs_ddp']:>7.0f}x {target:>7}"
        )
    if agg["ddp"]:
        d = agg["ddp"]
        print(f"ddp (seed 0): final_eval_bpb {d['final_eval_bpb']:.4f}, bytes {d['bytes_up']} ({d['bytes_up'] // (d['rounds'] * d['sync_every'])} per step)")
    print("target column: 0.95 x H x 32 / bits, with bits = 32 x formula / fp32 formula (scales and headers included)")
    print("=" * 118)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    results = out / "results.json"
    if args.summarize:
        data = json.loads(results.read_text())
        print_table(data["aggregate"], data["meta"]["sync_every"])
        return 0
    plan = [(v, s, "diloco") for s in args.seed_list for v in args.variant_list]
    if not args.no_ddp:
        plan.insert(len(args.variant_list), ("ddp", args.seed_list[0], "ddp"))
    configs = {(v, s): build(args, "fp32" if m == "ddp" else v, s, m) for v, s, m in plan}
    out.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "sync_every": args.sync_every, "rounds": args.rounds, "sites": args.sites, "model": args.model}
    runs: list[dict[str, Any]] = []
    for v, s, _ in plan:
        cfg = configs[(v, s)]
        run_dir = out / f"{v.replace(':', '_')}_seed{s}"
        done = run_dir / "summary.json"
        if done.exists():  # resume: a finished run is read back, not run again
            summary = json.loads(done.read_text())
            summary.update(variant=v, run_dir=str(run_dir), formula_bytes_per_round=formula_bytes_per_site(cfg) * cfg.sites)
            runs.append(summary)
            print(f"{v:<15} seed={s} (done before) final_eval_bpb={summary['final_eval_bpb']:.4f}", flush=True)
            continue
        try:
            summary = run_simulation(cfg, run_dir, timeout_s=args.timeout_s, progress=None)
        except SimStopped:
            raise
        except SimError as e:
            print(f"{v:<15} seed={s} FAILED: {e}", flush=True)
            runs.append({"variant": v, "seed": s, "error": str(e)})
            continue
        summary.update(variant=v, run_dir=str(run_dir), formula_bytes_per_round=formula_bytes_per_site(cfg) * cfg.sites)
        runs.append(summary)
        print(
            f"{v:<15} seed={s} final_eval_bpb={summary['final_eval_bpb']:.4f} bytes_up={summary['bytes_up']} hashes_equal={summary['hashes_equal']} wall_s={summary['wall_s']:.0f}",
            flush=True,
        )
        write_json_atomic(results, {"meta": meta, "runs": runs, "aggregate": aggregate(runs, args.variant_list)})
    agg = aggregate(runs, args.variant_list)
    write_json_atomic(results, {"meta": meta, "runs": runs, "aggregate": agg})
    print_table(agg, args.sync_every)
    print(f"results: {results}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
