"""Fault tolerance, measured: goodput, rounds and final eval bpb of diloco-sim runs with
injected faults next to clean runs with the same seed and tokens per site.

Scenarios (tiny model, H = --sync-every, --rounds rounds, seed --seed):

* ``clean4`` / ``clean3``: 4 and 3 sites, no faults (the bpb bracket for ``kill_every``);
* ``kill_every``: 4 sites; every ``--kill-every`` rounds one site (in turn) is SIGKILLed half-way
  through its inner phase and started again after 2 s;
* ``kill_push_pull``: 4 sites; site 1 SIGKILLed after the first chunk of its push (round
  rounds/3), site 2 after its update arrived, before applying it (round 2 rounds/3);
* ``network``: 4 sites, lease 10 s; site 0 cut off for 20 s when it wants to push round
  rounds/2 (evicted, joins again), every push attempt lost with probability 0.1 (sent again);
* ``straggler``: 4 sites, site 3 is 3x slower, round deadline = 1.1 x the median push time
  once 3 sites have pushed (``quorum.deadline=median``, ``quorum.min_sites=3``): the
  straggler is dropped when late (``quorum.late=drop``);
* ``straggler_merge``: the same, but its late push is merged into the open round with weight
  0.5 ^ rounds late (``quorum.late=merge``, at most 3 rounds late);
* ``straggler_merge_dn`` / ``clean4_dn``: ``straggler_merge`` and ``clean4`` with the Delayed
  Nesterov outer optimizer (``outer.name=DelayedNesterov``, ``outer.period=--dn-period``);
* ``straggler_wait``: the same straggler with no deadline (every round waits for it);
* ``coordinator_x3``: 4 sites, the coordinator SIGKILLed three times (between rounds, mid round,
  between rounds) and started again after 2 s.

For each run: final eval bpb and its % against clean4, rounds committed, whether the rounds in
metrics.jsonl are consecutive with no repeats, whether every site ends bit-identical, goodput,
faults injected, and the median and mean round time (``wall_s`` of metrics.jsonl, round 0
excluded: it includes start-up) against clean4's. Results go to OUT/results.json; a scenario
whose summary.json exists in OUT is read back instead of run again.

    .venv/bin/python scripts/bench_faults.py --out runs/bench_faults/readme
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from diloco.app.config import run_config_from_dict
from diloco.io import read_jsonl, write_json_atomic
from diloco.sim.launcher import SimStopped, run_simulation

SCENARIOS = (
    "clean4",
    "clean3",
    "kill_every",
    "kill_push_pull",
    "network",
    "straggler",
    "straggler_merge",
    "straggler_wait",
    "coordinator_x3",
    "clean4_dn",
    "straggler_merge_dn",
)


def scenario_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, Any] = {"sites": 4, "rounds": args.rounds, "seed": args.seed, "eval_every": args.rounds, "sync": {"every": args.sync_every}}
    if name.endswith("_dn"):
        return {**scenario_config(name[: -len("_dn")], args), "outer": {"name": "DelayedNesterov", "period": args.dn_period}}
    if name == "clean3":
        return {**base, "sites": 3}
    if name == "kill_every":
        kills = [
            {"kind": "kill_site", "site": i % 4, "at_round": r, "phase": "inner", "restart_after_s": 2.0}
            for i, r in enumerate(range(args.kill_every - 1, args.rounds - 1, args.kill_every))
        ]
        return {**base, "faults": {"events": kills}}
    if name == "kill_push_pull":
        r = args.rounds
        events = [
            {"kind": "kill_site", "site": 1, "at_round": r // 3, "phase": "push", "restart_after_s": 2.0},
            {"kind": "kill_site", "site": 2, "at_round": 2 * r // 3, "phase": "pull", "restart_after_s": 2.0},
        ]
        return {**base, "faults": {"events": events}}
    if name == "network":
        events = [{"kind": "partition_site", "site": 0, "at_round": args.rounds // 2, "seconds": 20.0}, {"kind": "drop_push", "prob": 0.1}]
        return {**base, "quorum": {"lease_s": 10.0, "min_sites": 3}, "faults": {"events": events}}
    if name.startswith("straggler"):
        slow = {"faults": {"events": [{"kind": "slow_site", "site": 3, "factor": 3.0}]}}
        if name == "straggler_wait":
            return {**base, **slow}
        quorum = {"deadline": "median", "deadline_factor": 1.1, "min_sites": 3}
        if name == "straggler_merge":
            quorum.update(late="merge", late_discount=0.5, max_staleness=3)
        return {**base, **slow, "quorum": quorum}
    if name == "coordinator_x3":
        r = args.rounds
        events = [
            {"kind": "kill_coordinator", "at_round": r // 4, "phase": "between", "restart_after_s": 2.0},
            {"kind": "kill_coordinator", "at_round": r // 2, "phase": "mid", "restart_after_s": 2.0},
            {"kind": "kill_coordinator", "at_round": 3 * r // 4, "phase": "between", "restart_after_s": 2.0},
        ]
        return {**base, "faults": {"events": events}}
    return base


def measure(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    times = [m["wall_s"] for m in metrics[1:] if not m.get("recovered")]
    return {
        "final_eval_bpb": summary["final_eval_bpb"],
        "rounds_committed": summary["rounds_committed"],
        "consecutive": [m["round"] for m in metrics] == list(range(summary["rounds"])),
        "hashes_equal": summary["hashes_equal"],
        "goodput": summary["goodput"],
        "faults": len(summary["faults_injected"]),
        "round_s_median": statistics.median(times) if times else None,
        "round_s_mean": statistics.mean(times) if times else None,
        "dropped_late": sum(len(m["late"]) for m in metrics),
        "wall_s": summary["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_faults.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--kill-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dn-period", type=int, default=2, help="outer.period of the *_dn scenarios")
    p.add_argument("--out", type=Path, default=Path("runs/bench_faults/latest"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        if name not in SCENARIOS:
            p.error(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        run_dir = args.out / name
        done = run_dir / "summary.json"
        if done.exists():
            summary = json.loads(done.read_text())
        else:
            d = scenario_config(name, args)
            faults = d.pop("faults", None)  # the simulation's own section, not the run's
            cfg = run_config_from_dict(d)
            print(f"== {name}", flush=True)
            try:
                summary = run_simulation(cfg, run_dir, timeout_s=7200, progress=None, faults=faults)
            except SimStopped:
                return 1
        results[name] = measure(run_dir, summary)
        write_json_atomic(args.out / "results.json", results)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print_table(results)
    return 0


def print_table(results: dict[str, Any]) -> None:
    ref = results.get("clean4")
    print(
        f"{'scenario':<16} {'bpb':>7} {'vs clean4':>9} {'rounds':>6} {'consec':>6} {'hashes':>6} {'goodput':>7} {'faults':>6} {'late':>4} {'round s (median/mean)':>22} {'vs clean4':>9}"
    )
    for name, r in results.items():
        vs = f"{100 * (r['final_eval_bpb'] / ref['final_eval_bpb'] - 1):+.2f}%" if ref else "-"
        t = f"{r['round_s_median']:.2f}/{r['round_s_mean']:.2f}" if r["round_s_median"] is not None else "-"
        tvs = f"{r['round_s_mean'] / ref['round_s_mean']:.2f}x" if ref and r["round_s_mean"] else "-"
        print(
            f"{name:<16} {r['final_eval_bpb']:>7.4f} {vs:>9} {r['rounds_committed']:>6} {str(r['consecutive']):>6} {str(r['hashes_equal']):>6} "
            f"{r['goodput']:>7.4f} {r['faults']:>6} {r['dropped_late']:>4} {t:>22} {tvs:>9}"
        )


if __name__ == "__main__":
    sys.exit(main())
