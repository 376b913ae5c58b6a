"""Quality benchmark: final held-out bits-per-byte of DiLoCo vs synchronous DDP vs one worker.

What it measures
----------------
On the shipped corpus, with the same model and the same number of inner steps per worker
(rounds x sync_every), for each seed it runs:

* ``mode=diloco``: ``sites`` sites + a coordinator, an outer sync every H = sync_every steps
  (sites x rounds x H steps in all: ``sites`` times the tokens of ``single``);
* ``mode=ddp``: ``sites`` ranks with a gradient all-reduce every step (the same total tokens
  as diloco);
* ``mode=single``: one worker, rounds x H steps.

For every run it reports the final held-out eval bits-per-byte (``final_eval_bpb``), tokens,
bytes up/down, wall time and whether every worker ended on the coordinator's final weights.
The summary gives per mode the median and mean bpb over seeds, each seed's value, tokens,
bytes_up per round and median wall time; the per-seed comparisons summarized as medians
(diloco vs ddp in % -- positive means diloco is worse -- and diloco vs single in % better);
diloco's bytes_up per round next to the fp32 formula 4 x params x sites; and the peak RSS of
the diloco coordinator and of site 0. Everything also goes to OUT/results.json.

Runs are made one at a time through ``diloco.sim.launcher.run_simulation`` (each run is
several OS processes with one torch thread each), with the config built from the library's
defaults (``RunConfig()``, the same values as conf/run.yaml), not through hydra.

Reproducing the README figures (3 seeds, tiny model, 4 sites, H=50, 10 rounds)::

    .venv/bin/python scripts/bench_quality.py \\
        --model tiny --sites 4 --sync-every 50 --rounds 10 --seeds 0,1,2 \\
        --modes diloco,ddp,single --out runs/bench_quality/readme

(these are the defaults: ``.venv/bin/python scripts/bench_quality.py`` does the same, writing
to runs/bench_quality/<timestamp>). Smoke test, under a minute: ``--quick``.

A sweep: ``--grid KEY=V1|V2|...`` (repeatable) runs DiLoCo at every point of the grid and each
baseline once per seed, and prints per point the median bpb, % better than one worker and %
worse than data parallel, each seed against the baselines of its own seed::

    .venv/bin/python scripts/bench_quality.py --seeds 0,1,2 --grid 'outer.lr=0.7|1.0' \
        --grid 'outer.momentum_warmup=0|5' --out runs/sweep

``--set data.path=FILE`` runs it on another corpus. ``faults.events`` (``--set`` or ``--grid``,
JSON) injects the simulator's faults into the DiLoCo runs, e.g. pseudo-gradients lost for good
with probability 0.3: ``--set 'faults.events=[{"kind":"drop_push","prob":0.3,"lost":true}]'``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from diloco.app.config import ConfigError, RunConfig, run_config_defaults, run_config_from_dict
from diloco.data import DataError
from diloco.io import read_jsonl, write_json_atomic
from diloco.sim.faults import FaultsConfig
from diloco.sim.launcher import SimError, SimStopped, run_simulation
from diloco.sim.sections import sim_faults

ALL_MODES = ("diloco", "ddp", "single")
DEFAULTS: dict[str, Any] = {"rounds": 10, "sync_every": 50, "sites": 4, "seeds": "0,1,2"}
QUICK: dict[str, Any] = {"rounds": 2, "sync_every": 5, "sites": 2, "seeds": "0"}


# ---------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_quality.py",
        description="Final held-out eval bpb of diloco vs ddp vs single at equal inner steps per worker.",
    )
    p.add_argument("--model", default="tiny", help="model preset (diloco/model_config.py MODEL_SIZES); default tiny")
    p.add_argument("--rounds", type=int, default=None, help=f"outer rounds (default {DEFAULTS['rounds']}; --quick: {QUICK['rounds']})")
    p.add_argument("--sync-every", type=int, default=None, help=f"H, inner steps per round (default {DEFAULTS['sync_every']}; --quick: {QUICK['sync_every']})")
    p.add_argument("--sites", type=int, default=None, help=f"diloco sites / ddp ranks (default {DEFAULTS['sites']}; --quick: {QUICK['sites']})")
    p.add_argument("--seeds", default=None, help=f"comma-separated seeds (default {DEFAULTS['seeds']}; --quick: {QUICK['seeds']})")
    p.add_argument("--modes", default=",".join(ALL_MODES), help="comma-separated subset of diloco,ddp,single")
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/bench_quality/<timestamp>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override in dotted form, applied to every run (repeatable), e.g. --set inner.lr=0.002 --set outer.lr=0.5; "
        "VALUE is parsed as JSON when it can be, else taken as a string",
    )
    p.add_argument(
        "--grid",
        dest="grid",
        action="append",
        default=[],
        metavar="KEY=V1|V2|...",
        help="a sweep axis for the diloco runs (repeatable; the runs are the cartesian product of the axes), e.g. --grid outer.lr=0.7|1.0 "
        "--grid outer.momentum_warmup=0|5; values parsed as JSON when they can be. The baselines run once per seed (and per distinct "
        "baseline config: a sync_every_schedule changes their steps)",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per-run timeout passed to run_simulation (default 3600)")
    p.add_argument("--quick", action="store_true", help="smoke test: rounds=2, sync.every=5, seeds=0, sites=2 (explicit flags still win)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key in ("rounds", "sync_every", "sites", "seeds"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    try:
        args.seed_list = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not args.seed_list:
        p.error("--seeds: no seed given")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in ALL_MODES]
    if bad or not args.mode_list:
        p.error(f"--modes {args.modes!r}: expected a comma-separated subset of {','.join(ALL_MODES)}")
    if args.out is None:
        args.out = Path("runs") / "bench_quality" / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        args.override_pairs = [parse_override(s) for s in args.overrides]
        args.grid_axes = [parse_axis(s) for s in args.grid]
    except ValueError as e:
        p.error(str(e))
    return args


def parse_axis(text: str) -> tuple[list[str], list[Any]]:
    """``"outer.lr=0.7|1.0"`` -> (["outer", "lr"], [0.7, 1.0])."""
    key, sep, raw = text.partition("=")
    if not sep or not raw:
        raise ValueError(f"--grid {text!r}: expected KEY=V1|V2|... with a dotted KEY such as outer.lr=0.7|1.0")
    values = [parse_override(f"{key}={v}")[1] for v in raw.split("|")]
    return parse_override(f"{key}={raw.split('|')[0]}")[0], values


def variants(axes: list[tuple[list[str], list[Any]]]) -> list[tuple[str, list[tuple[list[str], Any]]]]:
    """Every point of the grid: (a label such as "outer.lr=1.0 outer.momentum=0.5", its overrides);
    no axes: one variant, "default" (the run's settings as given)."""
    points: list[list[tuple[list[str], Any]]] = [[]]
    for path, values in axes:
        points = [point + [(path, v)] for point in points for v in values]
    return [(" ".join(f"{'.'.join(p)}={json.dumps(v)}" for p, v in point) or "default", point) for point in points]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"inner.lr=0.002"`` -> (["inner", "lr"], 0.002); the value is JSON if it parses, else a string."""
    key, sep, raw = text.partition("=")
    path = [part for part in key.strip().split(".")]
    if not sep or not key.strip() or any(not part for part in path):
        raise ValueError(f"--set {text!r}: expected KEY=VALUE with a dotted KEY such as inner.lr=0.002")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return path, value


def apply_override(d: dict[str, Any], path: list[str], value: Any) -> None:
    node = d
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a config section")
        node = child
    node[path[-1]] = value


def build_config(args: argparse.Namespace, mode: str, seed: int, extra: list[tuple[list[str], Any]] | None = None) -> RunConfig:
    d = run_config_defaults()
    d.update(mode=mode, sites=args.sites, rounds=args.rounds, seed=seed)
    d["sync"]["every"] = args.sync_every
    # Replace the whole model section: the defaults hold every field of the tiny preset, which
    # would otherwise override the sizes of another preset.
    d["model"] = {"name": args.model}
    for path, value in [*args.override_pairs, *(extra or [])]:
        if (mode != "diloco" and diloco_only(path)) or path[0] == SIM_ONLY:
            continue  # the baselines have no outer step, codec or quorum; faults are the simulator's
        apply_override(d, path, copy.deepcopy(value))
    return run_config_from_dict(d)


def build_faults(args: argparse.Namespace, cfg: RunConfig, extra: list[tuple[list[str], Any]] | None = None) -> FaultsConfig | None:
    """The simulator's ``faults`` section of a run (DiLoCo runs only), checked against ``cfg``."""
    d: dict[str, Any] = {}
    for path, value in [*args.override_pairs, *(extra or [])]:
        if path[0] == SIM_ONLY and len(path) > 1:
            apply_override(d, path[1:], copy.deepcopy(value))
        elif path[0] == SIM_ONLY:
            raise ConfigError(f"{SIM_ONLY}: set faults.events, not the whole section")
    return sim_faults(d, cfg) if d and cfg.mode == "diloco" else None


# Settings only DiLoCo has: a grid over them runs each baseline once per seed. (A
# sync.schedule is applied to the baselines too: they train the same blocks.)
SIM_ONLY = "faults"  # run_simulation's own argument, not the run config's
DILOCO_ONLY = (
    "outer",
    "codec",
    "codec_down",
    "quorum",
    "error_feedback",
    "error_feedback_decay",
    "aggregate",
    "robust",
    "guard",
    "sync.fragments",
    "sync.split",
    "sync.end",
    "sync.overlap",
    "sync.local_weight",
    "sync.merge",
    "sync.mode",
    "sync.lookahead_weight",
    "sync.streams",
    "sync.budget_s",
)


def diloco_only(path: list[str]) -> bool:
    """An override of a setting only DiLoCo has (the baselines skip it)."""
    key = ".".join(path)
    return any(key == k or key.startswith(k + ".") for k in DILOCO_ONLY)


# ---------------------------------------------------------------------------- runs


def run_line(s: dict[str, Any]) -> str:
    bpb = s.get("final_eval_bpb")
    bpb_s = f"{bpb:.4f}" if isinstance(bpb, (int, float)) else str(bpb)
    return (
        f"mode={s['mode']:<6} seed={s['seed']:<3} final_eval_bpb={bpb_s:<7} tokens={s['tokens']:<9} "
        f"bytes_up={s['bytes_up']:<11} bytes_down={s['bytes_down']:<11} wall_s={s['wall_s']:<8.1f} hashes_equal={s['hashes_equal']}"
    )


def per_round_bytes_up(run_dir: Path) -> list[int]:
    return [int(m["bytes_up"]) for m in read_jsonl(run_dir / "metrics.jsonl")]


# ---------------------------------------------------------------------------- aggregate


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def aggregate(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    by_mode: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in modes}
    for r in ok:
        by_mode.setdefault(r["mode"], {})[r["seed"]] = r
    per_mode: dict[str, Any] = {}
    for mode in modes:
        rs = by_mode.get(mode, {})
        bpbs = {seed: r["final_eval_bpb"] for seed, r in sorted(rs.items()) if r["final_eval_bpb"] is not None}
        vals = list(bpbs.values())
        per_mode[mode] = {
            "seeds": sorted(rs),
            "final_eval_bpb": {str(k): v for k, v in bpbs.items()},
            "final_eval_bpb_median": _median(vals),
            "final_eval_bpb_mean": _mean(vals),
            "tokens": sorted({r["tokens"] for r in rs.values()}),
            "bytes_up_per_round": sorted({r["bytes_up"] / r["rounds"] for r in rs.values()}),
            "wall_s_median": _median([r["wall_s"] for r in rs.values()]),
            "hashes_equal_all": all(r["hashes_equal"] for r in rs.values()) if rs else None,
        }

    def compare(a: str, b: str, better: bool) -> dict[str, Any] | None:
        if a not in by_mode or b not in by_mode:
            return None
        pct: dict[str, float] = {}
        for seed, ra in sorted(by_mode[a].items()):
            rb = by_mode[b].get(seed)
            if rb is None or ra["final_eval_bpb"] is None or rb["final_eval_bpb"] is None:
                continue
            x, y = ra["final_eval_bpb"], rb["final_eval_bpb"]
            # better=False: % worse of a vs b ((a - b) / b); better=True: % better ((b - a) / b).
            pct[str(seed)] = 100.0 * ((y - x) if better else (x - y)) / y
        return {"per_seed_pct": pct, "median_pct": _median(list(pct.values()))}

    out: dict[str, Any] = {
        "per_mode": per_mode,
        "diloco_vs_ddp_pct_worse": compare("diloco", "ddp", better=False),
        "diloco_vs_single_pct_better": compare("diloco", "single", better=True),
    }
    diloco_runs = [by_mode["diloco"][s] for s in sorted(by_mode.get("diloco", {}))]
    if diloco_runs:
        checks = []
        for r in diloco_runs:
            formula = 4 * r["params"] * r["sites"]
            rounds = per_round_bytes_up(Path(r["run_dir"]))
            checks.append(
                {
                    "seed": r["seed"],
                    "codec": r["codec"],
                    "params": r["params"],
                    "sites": r["sites"],
                    "bytes_up_per_round": r["bytes_up"] / r["rounds"],
                    "per_round_bytes_up_min": min(rounds) if rounds else None,
                    "per_round_bytes_up_max": max(rounds) if rounds else None,
                    "fp32_formula_4_params_sites": formula,
                    "agree_exactly": bool(rounds)
                    and len(rounds) == r["rounds"]
                    and all(b == formula for b in rounds)
                    and r["bytes_up"] == formula * r["rounds"],
                    "peak_rss_mb_coordinator": r["peak_rss_mb"].get("coordinator"),
                    "peak_rss_mb_site0": r["peak_rss_mb"].get("0"),
                }
            )
        out["diloco_bytes_and_memory"] = checks
    return out


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(agg: dict[str, Any]) -> None:
    print()
    print("=" * 100)
    print(f"{'mode':<7} {'bpb median':>10} {'bpb mean':>9}  {'per seed':<30} {'tokens':>10} {'bytes_up/round':>15} {'wall median s':>13}")
    for mode, m in agg["per_mode"].items():
        seeds = " ".join(f"{k}:{v:.4f}" for k, v in m["final_eval_bpb"].items()) or "-"
        tokens = ",".join(str(t) for t in m["tokens"]) or "-"
        bup = ",".join(f"{b:.0f}" for b in m["bytes_up_per_round"]) or "-"
        print(
            f"{mode:<7} {_f(m['final_eval_bpb_median']):>10} {_f(m['final_eval_bpb_mean']):>9}  {seeds:<30} {tokens:>10} {bup:>15} {_f(m['wall_s_median'], '.1f'):>13}"
        )
    print()
    for key, label in (
        ("diloco_vs_ddp_pct_worse", "diloco vs ddp   (% worse, + = diloco worse)"),
        ("diloco_vs_single_pct_better", "diloco vs single (% better)"),
    ):
        c = agg.get(key)
        if c is None:
            continue
        seeds = " ".join(f"{k}:{v:+.2f}%" for k, v in c["per_seed_pct"].items()) or "-"
        med = "-" if c["median_pct"] is None else f"{c['median_pct']:+.2f}%"
        print(f"{label:<45} median {med:>8}   per seed {seeds}")
    for c in agg.get("diloco_bytes_and_memory", []):
        print(
            f"diloco seed {c['seed']}: bytes_up/round {c['bytes_up_per_round']:.0f} vs 4 x params x sites = 4 x {c['params']} x {c['sites']} = "
            f"{c['fp32_formula_4_params_sites']} (codec {c['codec']}): agree exactly: {c['agree_exactly']}; "
            f"peak_rss_mb coordinator {c['peak_rss_mb_coordinator']} site0 {c['peak_rss_mb_site0']}"
        )
    print("=" * 100)


# ---------------------------------------------------------------------------- main


def _run(cfg: RunConfig, run_dir: Path, timeout_s: float, label: str, faults: FaultsConfig | None = None) -> dict[str, Any]:
    try:
        summary = run_simulation(cfg, run_dir, timeout_s=timeout_s, progress=None, faults=faults)
    except SimStopped:
        raise
    except (SimError, DataError) as e:
        print(f"{label} FAILED: {e}", flush=True)
        return {"mode": cfg.mode, "seed": cfg.seed, "run_dir": str(run_dir), "error": str(e)}
    print(f"{label} {run_line(summary)}", flush=True)
    return summary


def _pct(x: float | None, y: float | None, better: bool) -> float | None:
    if x is None or y is None:
        return None
    return 100.0 * ((y - x) if better else (x - y)) / y


def grid_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: DiLoCo's bpb per seed, % better than one worker and % worse than data
    parallel per seed (each against the baseline run of its own seed and steps), and their
    medians and spreads."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant]
        entry: dict[str, Any] = {"variant": variant, "seeds": [r["seed"] for r in rs], "bpb": [r["bpb"] for r in rs]}
        for key, better in (("vs_single_pct_better", True), ("vs_ddp_pct_worse", False)):
            base = "single" if better else "ddp"
            vals = [_pct(r["bpb"], r.get(base), better) for r in rs]
            vals = [v for v in vals if v is not None]
            entry[key] = vals
            entry[key + "_median"] = _median(vals)
        entry["bpb_median"] = _median([b for b in entry["bpb"] if b is not None])
        out.append(entry)
    return out


def print_grid(table: list[dict[str, Any]]) -> None:
    print()
    print(f"{'variant':<70} {'bpb median':>10} {'vs single (better)':>20} {'vs ddp (worse)':>16}  per seed (bpb / vs single / vs ddp)")
    for e in table:

        def spread(vals: list[float]) -> str:
            return f"{_median(vals):+.2f}%" if vals else "-"

        seeds = "; ".join(f"{seed}: {_f(b)}" for seed, b in zip(e["seeds"], e["bpb"]))
        singles = " ".join(f"{v:+.2f}" for v in e["vs_single_pct_better"])
        ddps = " ".join(f"{v:+.2f}" for v in e["vs_ddp_pct_worse"])
        print(
            f"{e['variant']:<70} {_f(e['bpb_median']):>10} {spread(e['vs_single_pct_better']):>20} {spread(e['vs_ddp_pct_worse']):>16}  {seeds} / [{singles}] / [{ddps}]"
        )


def main_grid(args: argparse.Namespace, out: Path) -> int:
    """The sweep: every grid point for DiLoCo, each baseline once per seed and distinct config."""
    from diloco.app.config import run_config_to_dict

    points = variants(args.grid_axes)
    baselines = [m for m in args.mode_list if m != "diloco"]
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    meta = {
        "argv": sys.argv[1:],
        "sites": args.sites,
        "sync_every": args.sync_every,
        "rounds": args.rounds,
        "seeds": args.seed_list,
        "overrides": args.overrides,
        "grid": args.grid,
    }
    print(f"bench_quality grid: {len(points)} point(s) x {len(args.seed_list)} seed(s), baselines {','.join(baselines) or 'none'} -> {out}", flush=True)
    done: dict[str, dict[str, Any]] = {}  # a baseline's config (JSON) -> its summary
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for seed in args.seed_list:
        for i, (label, point) in enumerate(points):
            row: dict[str, Any] = {"variant": label, "seed": seed}
            for mode in baselines:
                cfg = build_config(args, mode, seed, point)
                key = json.dumps(run_config_to_dict(cfg), sort_keys=True, default=str)
                if key not in done:
                    done[key] = _run(cfg, out / f"{mode}_seed{seed}_{len(done)}", args.timeout_s, f"[{mode}]")
                    runs.append(done[key])
                row[mode] = done[key].get("final_eval_bpb")
            if "diloco" in args.mode_list:
                cfg = build_config(args, "diloco", seed, point)
                summary = _run(cfg, out / f"diloco_seed{seed}_v{i}", args.timeout_s, f"[{label}]", build_faults(args, cfg, point))
                summary["variant"] = label
                runs.append(summary)
                row["bpb"] = summary.get("final_eval_bpb")
                row["hashes_equal"] = summary.get("hashes_equal")
                # A round closed without a site (a slow start on a busy machine) changes the run: say so.
                lines = read_jsonl(Path(summary.get("run_dir", out / "none")) / "metrics.jsonl")
                row["every_site_every_round"] = bool(lines) and all(len(m["participants"]) == args.sites for m in lines)
                if not row["every_site_every_round"]:
                    print(f"[{label}] warning: some round closed without every site", flush=True)
            rows.append(row)
            write_json_atomic(results_path, {"meta": meta, "runs": runs, "rows": rows, "table": grid_table(rows)})
    table = grid_table(rows)
    write_json_atomic(results_path, {"meta": meta, "runs": runs, "rows": rows, "table": table})
    print_grid(table)
    print(f"results: {results_path}")
    return 1 if any("error" in r for r in runs) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    if args.grid_axes:
        try:
            for _label, point in variants(args.grid_axes):
                for mode in args.mode_list:  # every point's config is checked before any run
                    build_faults(args, build_config(args, mode, args.seed_list[0], point), point)
        except ConfigError as e:
            print(f"error: bad config: {e}", file=sys.stderr)
            return 2
        return main_grid(args, out)
    plan = [(mode, seed) for seed in args.seed_list for mode in args.mode_list]
    try:
        configs = {(mode, seed): build_config(args, mode, seed) for mode, seed in plan}
        faults = {key: build_faults(args, cfg) for key, cfg in configs.items()}
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(configs.values()))
    print(
        f"bench_quality: model={first.model.name} sites={first.sites} H={first.sync.every} rounds={first.rounds} "
        f"seeds={','.join(map(str, args.seed_list))} modes={','.join(args.mode_list)} overrides={args.overrides} -> {out}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    results_path = out / "results.json"
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "model": first.model.name,
        "sites": first.sites,
        "sync_every": first.sync.every,
        "rounds": first.rounds,
        "seeds": args.seed_list,
        "modes": args.mode_list,
        "overrides": args.overrides,
    }
    for mode, seed in plan:
        cfg = configs[(mode, seed)]
        run_dir = out / f"{mode}_seed{seed}"
        try:
            summary = run_simulation(cfg, run_dir, timeout_s=args.timeout_s, progress=None, faults=faults[(mode, seed)])
        except SimStopped:
            raise
        except (SimError, DataError) as e:
            print(f"mode={mode:<6} seed={seed:<3} FAILED: {e}", flush=True)
            runs.append({"mode": mode, "seed": seed, "run_dir": str(run_dir), "error": str(e)})
        else:
            print(run_line(summary), flush=True)
            runs.append(summary)
        # Written after every run so a long benchmark leaves its partial results behind.
        write_json_atomic(results_path, {"meta": meta, "runs": runs, "aggregate": aggregate(runs, args.mode_list)})
    agg = aggregate(runs, args.mode_list)
    write_json_atomic(results_path, {"meta": meta, "runs": runs, "aggregate": agg})
    print_table(agg)
    print(f"results: {results_path}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
