"""What security costs, and what hostile clients get, measured on this machine (loopback).

Parts (``--part``, default all):

* ``goodput``: push and pull goodput (payload MB/s) of one site against a coordinator in
  another process, plaintext against TLS with client certificates and tokens (the default),
  ``--params`` float32 parameters, ``--repeats`` rounds each, alternating (ratio in one sitting);
* ``sim``: the default diloco-sim (4 sites, tiny model, H=50) for ``--sim-rounds`` rounds with
  its credentials (TLS, client certificates, tokens) and without (``sim.credentials=false``),
  ``--sim-repeats`` times each, alternating: the median round time and the sites' median sync
  time (push + wait + pull);
* ``hostile``: a real diloco-coordinator process with the default security and two real
  diloco-site processes, with and without ``--connections`` hostile connections
  (tests/hostile.py: plaintext, no client certificate, another CA's certificate, and a client
  holding a real site's leaked credentials that stalls pushes and impersonates): rounds
  completed, the coordinator's peak resident memory and peak threads (/proc);
* ``robust``: 4 sites, one of which pushes its Δ x 30 from round 1 (the ``poison_push``
  fault), ``--robust-rounds`` rounds at H=20: final eval bpb with no defence, the norm bound
  (reject, clip) and the coordinate-wise median, against the clean run;
* ``fuzz``: ``--fuzzers`` hostile clients (each with the credentials of a site of its own)
  x ``--messages`` random valid and invalid messages against a coordinator with the default
  security while a legitimate 2-site run goes on: messages, refusals by code, crashes.

    .venv/bin/python scripts/bench_security.py --out runs/bench_security
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the hostile clients live with the tests

import torch  # noqa: E402

from diloco.codec import get_codec  # noqa: E402
from diloco.security.config import SecurityConfig  # noqa: E402
from diloco.security.store import write_run_credentials  # noqa: E402
from diloco.transport import CoordinatorClient  # noqa: E402
from diloco.types import JoinRequest, PushHeader  # noqa: E402
from diloco.wire import encode_chunks  # noqa: E402
from diloco.wire.fingerprint import fingerprint  # noqa: E402

SITES = ["a", "b", "x"]


def _theta(params: int) -> dict[str, torch.Tensor]:
    rows = params // 1024
    return {f"layer{i}.w": torch.randn(rows // 4, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)}


def _coordinator_process(params: int, rounds: int, security: dict[str, Any] | None, port_out: Any, stop: Any) -> None:
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.outer import OuterConfig
    from diloco.transport import serve

    coord = Coordinator(_theta(params), OuterConfig(), CoordinatorConfig(total_rounds=rounds, min_sites=2, max_concurrent_pushes=2))
    server, port = serve(coord, "127.0.0.1", 0, security=SecurityConfig(**security) if security else None)
    port_out.put(port)
    stop.wait()
    server.stop(None)


def goodput(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    creds = out / "credentials"
    if not (creds / "ca.pem").exists():
        write_run_credentials(creds, SITES, hosts=["localhost", "127.0.0.1"], days=30, force=True)
    theta = _theta(args.params)
    fp32 = get_codec("fp32")
    modes = {"plaintext": None, "tls+mtls+token": {"dir": str(creds)}}
    times: dict[str, dict[str, list[float]]] = {m: {"push": [], "pull": []} for m in modes}
    payload = sum(t.numel() * 4 for t in theta.values())
    ctx = mp.get_context("spawn")
    for rep in range(args.repeats):
        for mode, security in modes.items() if rep % 2 == 0 else reversed(list(modes.items())):
            q, stop = ctx.Queue(), ctx.Event()
            proc = ctx.Process(target=_coordinator_process, args=(args.params, 4, security, q, stop))
            proc.start()
            port = q.get(timeout=120)
            cfg = SecurityConfig(**security) if security else None
            clients = {s: CoordinatorClient(f"127.0.0.1:{port}", timeout_s=300, security=cfg, site_id=s) for s in ("a", "b")}
            try:
                for s, c in clients.items():
                    c.join(JoinRequest(s, tuple(fingerprint(theta).values())))
                delta = {n: torch.full_like(t, 1e-3) for n, t in theta.items()}
                chunks = list(encode_chunks(delta, codec=fp32))
                for r in range(2):
                    t0 = time.perf_counter()
                    clients["a"].push(PushHeader(site_id="a", round=r, tokens=10, train_loss=1.0, inner_steps=1), chunks)
                    if r == 1:  # the first round warms both ends up
                        times[mode]["push"].append(time.perf_counter() - t0)
                    clients["b"].push(PushHeader(site_id="b", round=r, tokens=10, train_loss=1.0, inner_steps=1), chunks)
                    clients["a"].wait_round("a", r, timeout_s=60)
                    t0 = time.perf_counter()
                    clients["a"].pull_global("a")
                    if r == 1:
                        times[mode]["pull"].append(time.perf_counter() - t0)
            finally:
                for c in clients.values():
                    c.close()
                stop.set()
                proc.join(30)
    result: dict[str, Any] = {"params": args.params, "payload_mb": payload / 1e6, "repeats": args.repeats}
    for mode in modes:
        for what in ("push", "pull"):
            med = statistics.median(times[mode][what])
            result[f"{mode} {what} MB/s"] = round(payload / med / 1e6, 1)
            result[f"{mode} {what} s (all)"] = [round(t, 4) for t in times[mode][what]]
    for what in ("push", "pull"):
        result[f"TLS/plaintext {what} time ratio"] = round(statistics.median(times["tls+mtls+token"][what]) / statistics.median(times["plaintext"][what]), 3)
    return result


def _sim(run_dir: Path, *overrides: str) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [str(ROOT / ".venv/bin/diloco-sim"), *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    workers = [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("*.json"))]
    sync = [sum(rank[k] for k in ("push_s", "wait_s", "pull_s")) for w in workers for rank in w["sync_s_median_per_rank"]]
    return {
        "round_s": statistics.median(m["wall_s"] for m in metrics[1:]),
        "sync_s": statistics.median(sync),
        "wall_s": json.loads((run_dir / "summary.json").read_text())["wall_s"],
    }


def sim(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    modes = {"secure (default)": [], "plaintext": ["sim.credentials=false"]}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(args.sim_repeats):
        for mode, extra in modes.items() if rep % 2 == 0 else reversed(list(modes.items())):
            runs[mode].append(_sim(out / f"sim_{mode.split()[0]}_{rep}", f"rounds={args.sim_rounds}", f"eval_every={args.sim_rounds}", *extra))
    result: dict[str, Any] = {"rounds": args.sim_rounds, "repeats": args.sim_repeats}
    for mode in modes:
        for key in ("round_s", "sync_s"):
            result[f"{mode} median {key}"] = round(statistics.median(r[key] for r in runs[mode]), 3)
        result[f"{mode} runs"] = runs[mode]
    for key in ("round_s", "sync_s"):
        result[f"secure/plaintext {key} ratio"] = round(result[f"secure (default) median {key}"] / result[f"plaintext median {key}"], 3)
    return result


def _proc_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def _hostile_run(out: Path, connections: int, rounds: int) -> dict[str, Any]:
    from hostile import HostileLoad, Leaked

    from diloco.model import ModelConfig, build_model
    from diloco.security.certs import issue_site, make_ca

    run = out / f"hostile_{connections}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    creds = write_run_credentials(run / "credentials", ["0", "1", "x"], hosts=["localhost", "127.0.0.1"], days=30, force=True)
    # A fixed deadline: the leaked site x is a member that never pushes a whole Δ.
    common = [
        "sites=3",
        f"rounds={rounds}",
        "sync.every=10",
        f"eval_every={rounds}",
        f"security.dir={creds.dir}",
        "quorum.lease_s=20",
        "quorum.deadline=fixed",
        "quorum.deadline_s=5",
    ]
    port_file = run / "port.json"
    port_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coord = subprocess.Popen(
        [str(ROOT / ".venv/bin/diloco-coordinator"), *common, "coordinator.min_sites=2", "coordinator.port=0", f"coordinator.port_file={port_file}", f"hydra.run.dir={run / 'coordinator'}"],
        stdout=open(run / "coordinator.log", "w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    sites: list[subprocess.Popen[bytes]] = []
    load = None
    peak = {"VmHWM": 0, "Threads": 0}
    try:
        while not port_file.exists():
            time.sleep(0.1)
        port = json.loads(port_file.read_text())["port"]
        address = f"127.0.0.1:{port}"
        if connections:
            # The site whose credentials leaked is a member: its stalled pushes reach staging.
            theta = {n: p.detach() for n, p in build_model(ModelConfig(), 0).named_parameters()}
            with CoordinatorClient(address, connect_timeout_s=60, security=SecurityConfig(dir=str(creds.dir)), site_id="x") as c:
                c.join(JoinRequest("x", tuple(fingerprint(theta).values())))
            x = creds.site_pem("x")
            foreign = issue_site(make_ca("not the run's CA", 1), "0", 1)
            load = HostileLoad(address, creds.ca_pem(), Leaked("x", x.cert, x.key, creds.site_token("x")), (foreign.key, foreign.cert), theta, connections)
            load.start()
        start = time.monotonic()
        for s in ("0", "1"):
            sites.append(
                subprocess.Popen(
                    [str(ROOT / ".venv/bin/diloco-site"), *common, f"site.id={s}", f"site.coordinator={address}", f"hydra.run.dir={run / ('site' + s)}"],
                    stdout=open(run / f"site{s}.log", "w"),
                    stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            )
        while coord.poll() is None:
            if any(p.poll() not in (None, 0) for p in sites):
                raise RuntimeError(f"a site process failed: see {run}/site*.log")
            status = _proc_status(coord.pid)
            peak = {k: max(peak[k], status.get(k, 0)) for k in peak}
            time.sleep(0.2)
        elapsed = time.monotonic() - start
        report = load.finish() if load else None
    finally:
        if load:
            load.stop.set()
        for p in [*sites, coord]:
            p.kill()
            p.wait()
    g = json.loads((run / "coordinator" / "global.json").read_text())
    result = {
        "connections": connections,
        "rounds_committed": g["rounds_committed"],
        "coordinator_peak_rss_mb": round(peak["VmHWM"] / 1024, 1),
        "coordinator_peak_threads": peak["Threads"],
        "run_s": round(elapsed, 1),
    }
    if report:
        result.update(hostile_calls=report.counts.sent, by_code=dict(sorted(report.counts.codes.items())), crashes=len(report.counts.crashes))
    return result


def hostile(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return {"baseline": _hostile_run(out, 0, args.hostile_rounds), "hostile": _hostile_run(out, args.connections, args.hostile_rounds)}


def fuzz(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from hostile import Counts, Fuzzer, legit_site, site_channel

    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.coordinator.round_policy import QuorumConfig
    from diloco.outer import OuterConfig
    from diloco.transport import ServerLimits, serve

    rounds = 8
    theta = {"emb.w": torch.randn(16, 8, generator=torch.Generator().manual_seed(3)), "head.b": torch.zeros(8)}
    creds = write_run_credentials(out / "fuzz_credentials", ["a", "b", "x", "y"], hosts=["127.0.0.1"], days=30, force=True)
    security = SecurityConfig(dir=str(creds.dir))
    cfg = CoordinatorConfig(
        total_rounds=rounds, min_sites=2, sites=("a", "b", "x", "y"), quorum=QuorumConfig(lease_s=30, deadline="fixed", deadline_s=1.0, late="merge")
    )
    coord = Coordinator(theta, OuterConfig(), cfg)
    server, port = serve(coord, "127.0.0.1", 0, security=security, limits=ServerLimits(stream_idle_s=5.0))
    stop_ticker = coord.start_ticker(0.05)
    address = f"127.0.0.1:{port}"
    hashes: dict[str, str] = {}
    counts = Counts()
    channels = [site_channel(address, creds, ["x", "y"][i % 2]) for i in range(args.fuzzers)]
    start = time.monotonic()
    try:
        fuzzers = [Fuzzer(ch, seed=100 + i, members=[["x", "y"][i % 2]], theta=theta, total_rounds=rounds) for i, ch in enumerate(channels)]
        threads = [threading.Thread(target=f.run, args=(args.messages,)) for f in fuzzers]
        threads += [threading.Thread(target=legit_site, args=(address, s, theta, rounds, hashes, security)) for s in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in fuzzers:
            counts.merge(f.counts)
    finally:
        stop_ticker()
        server.stop(None)
        for ch in channels:
            ch.close()
    return {
        "fuzzers": args.fuzzers, "messages": counts.sent, "refused": counts.refusals, "crashes": len(counts.crashes), "by_code": dict(sorted(counts.codes.items())),
        "internal_details": dict(counts.internal), "rounds_committed": coord.committed_rounds, "legit_hashes_equal": hashes.get("a") == hashes.get("b") == coord.global_sha256(),
        "thread_deaths": int(coord.failed is not None), "seconds": round(time.monotonic() - start, 1),
    }  # fmt: skip


def robust(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One site of four pushes its Δ x 30 from round 1: final eval bpb with no defence, the
    norm bound (reject, clip) and the coordinate-wise median, against the clean run."""
    common = ["sites=4", f"rounds={args.robust_rounds}", "sync.every=20", f"eval_every={args.robust_rounds}", "sim.credentials=false"]
    poison = "faults.events=[{kind:poison_push,site:3,factor:30,at_round:1}]"
    cases = {
        "clean": [],
        "poisoned, no defence": [poison],
        "poisoned, robust.norm_ratio=3 (reject)": [poison, "robust.norm_ratio=3"],
        "poisoned, robust.norm_ratio=3 robust.action=clip": [poison, "robust.norm_ratio=3", "robust.action=clip"],
        "poisoned, aggregate=median": [poison, "aggregate=median"],
        "clean, aggregate=median": ["aggregate=median"],
    }
    result: dict[str, Any] = {}
    for i, (name, extra) in enumerate(cases.items()):
        run_dir = out / f"robust_{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        subprocess.run(
            [str(ROOT / ".venv/bin/diloco-sim"), *common, *extra, f"hydra.run.dir={run_dir}"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=3600,
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        result[name] = {
            "final_eval_bpb": round(summary["final_eval_bpb"], 4),
            "rounds_rejected": summary["rounds_rejected"],
            "refused_pushes": summary["refused_pushes"],
        }
    clean = result["clean"]["final_eval_bpb"]
    for r in result.values():
        r["vs clean %"] = round(100 * (r["final_eval_bpb"] / clean - 1), 2)
    return result


PARTS = {"goodput": goodput, "sim": sim, "hostile": hostile, "fuzz": fuzz, "robust": robust}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_security")
    p.add_argument("--part", choices=[*PARTS, "all"], default="all")
    p.add_argument("--params", type=int, default=8 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sim-rounds", type=int, default=3)
    p.add_argument("--sim-repeats", type=int, default=3)
    p.add_argument("--connections", type=int, default=300)
    p.add_argument("--hostile-rounds", type=int, default=6)
    p.add_argument("--fuzzers", type=int, default=4)
    p.add_argument("--messages", type=int, default=1500)
    p.add_argument("--robust-rounds", type=int, default=6)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name, fn in PARTS.items():
        if args.part in (name, "all"):
            print(f"== {name}", flush=True)
            results[name] = fn(args, args.out)
            print(json.dumps(results[name], indent=1), flush=True)
            results_path.write_text(json.dumps(results, indent=1))
    print(f"results: {results_path}")


if __name__ == "__main__":
    main()
