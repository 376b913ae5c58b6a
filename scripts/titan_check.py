"""A torchtitan site end to end against a local coordinator, for scripts/gpu_check.sh (one GPU,
one rank): starts ``diloco-coordinator`` (init=site, one site) on 127.0.0.1, runs
tests/titan_site.py under torchrun (``--mode trainer``: torchtitan's own Trainer as
``diloco.plugins.torchtitan.DiLoCoTrainer``; ``--mode loop``: our loop around torchtitan's
model and ``parallelize_llama``), and checks that after every round the site's whole θ is the
coordinator's, and that it left with the final θ. Writes one JSON (``--out``)::

    python scripts/titan_check.py --mode trainer --device cuda --out titan.json
    python scripts/titan_check.py --mode loop --device cpu --out titan.json   # a CPU dry run

Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("trainer", "loop"), default="trainer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="titan_check."))
    port_file = d / "port.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    coord = [sys.executable, "-m", "diloco.cli.coordinator", "init=site", "sites=1", f"rounds={args.rounds}", f"sync.every={args.sync_every}"]
    coord += ["coordinator.host=127.0.0.1", "coordinator.port=0", f"coordinator.port_file={port_file}", f"hydra.run.dir={d / 'coord'}"]
    result: dict = {"mode": args.mode, "device": args.device, "ranks": args.ranks, "rounds": args.rounds, "sync_every": args.sync_every, "ok": False}
    procs = []
    t0 = time.monotonic()
    try:
        procs.append(subprocess.Popen(coord, stdout=open(d / "coord.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=d))
        while not port_file.exists():
            if procs[0].poll() is not None or time.monotonic() > t0 + 60:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.2)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
        site = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", str(ROOT / "tests" / "titan_site.py")]
        site += ["--mode", args.mode, "--device", args.device, "--layers", str(args.layers), "--sync-every", str(args.sync_every)]
        site += ["--coordinator", address, "--site-id", "titan", "--dump", str(d / "dump"), "--out", str(d / "site.json")]
        procs.append(subprocess.Popen(site, stdout=open(d / "site.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT / "tests"))
        result["site_rc"] = procs[1].wait(timeout=args.timeout)
        result["coordinator_rc"] = procs[0].wait(timeout=60)
        site_result = json.loads((d / "site.json").read_text())
        metrics = [json.loads(line) for line in (d / "coord" / "metrics.jsonl").read_text().splitlines()]
        final = json.loads((d / "coord" / "global.json").read_text())
        by_round = {str(m["round"]): m["global_sha256"] for m in metrics}
        hashes = {r: h for r, h in site_result["round_sha256"].items() if r != "start"}
        result["checks"] = {
            "rounds_committed": final["rounds_committed"] == args.rounds,
            "every_round_theta_equals_coordinator": hashes == by_round and len(by_round) == args.rounds,
            "final_theta_equals_coordinator": site_result["global_sha256"] == final["global_sha256"],
            "theta0_from_the_site": final.get("init_from") == "site 'titan'",
        }
        result["site"] = {k: v for k, v in site_result.items() if k not in ("placements",)}
        result["train_loss"] = [m.get("train_loss") for m in metrics]
        result["tokens"] = [m.get("tokens") for m in metrics]
        result["ok"] = result["site_rc"] == 0 and result["coordinator_rc"] == 0 and all(result["checks"].values())
    except Exception as e:  # the JSON says what went wrong, with the logs' tails
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        if not result["ok"]:
            result["site_log"] = _tail(d / "site.log")
            result["coordinator_log"] = _tail(d / "coord.log", 2000)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_log")}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
