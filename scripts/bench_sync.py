"""The blocking outer sync's own cost, this project against torchft 0.2.0, side by side on
one machine (issue 16).

Both systems run 2 replicas as separate OS processes on 127.0.0.1, the same model (the
``tiny`` preset with ``--layers`` layers: 4 gives 836,736 parameters in 38 tensors), inner
AdamW for ``--H`` steps on random tokens, then one blocking outer sync: outer SGD, Nesterov,
lr 0.7, momentum 0.9, fp32 on the wire.

* ours: a coordinator process (``Coordinator`` behind ``serve``, plaintext on loopback, a
  checkpoint written every round as a real run does) and 2 site processes (``OuterSync``,
  ``InnerTrainer``). The parts of a site's sync come from ``OuterSync.stats.timings`` (delta,
  encode, push, wait, pull, apply); the coordinator's parts of the closing push from
  ``Coordinator.commit_timings()`` (receive+decode, the commit under the lock: mean, outer
  step with the downlink's encoding, record and θ's hash; the checkpoint; publishing).
* torchft: its ``LighthouseServer`` in a third process, and 2 replica processes, each with a
  ``Manager`` over ``ProcessGroupGloo`` and ``torchft.local_sgd.DiLoCo`` (sync_every=H). The
  sync is what runs inside the inner optimizer's step that triggers it (its post-hooks:
  quorum, Δ, allreduce, should_commit, outer step, saving θ), timed from a post-hook that
  runs before DiLoCo's to the end of ``step()``; its parts by wrapping torchft's methods.

Each round one replica is made late on purpose (``--stagger`` seconds of sleep after its
inner phase; the two take turns), so the other has pushed (joined the quorum) and is
waiting: the "last to arrive" is known, and its sync is the sync's own cost (computing Δ,
encoding, transfer, the commit, the pull, applying), with no waiting for the other in it.
What it waited for the other is subtracted anyway: the time from its arrival until the other
had pushed (ours) or arrived (torchft), 0 in every round here. The first ``--warmup`` rounds
(connections, first quorum, gloo's set-up) are left out of the figures.

    .venv/bin/python scripts/bench_sync.py --out runs/bench_sync/results.json
    .venv/bin/python scripts/bench_sync.py --systems ours --rounds 12

Needs torchft 0.2.0 in ``--torchft-python``'s environment (default /tmp/tftvenv/bin/python,
with torch; this checkout's ``diloco.model`` is imported from there through PYTHONPATH).
Prints a table (median, min and max of each part over the measured rounds) and writes
everything, per round, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()

OURS_PARTS = ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")
COORD_PARTS = ("first_chunk_s", "receive_s", "lock_s", "commit_s", "mean_s", "step_s", "encode_s", "record_s", "checkpoint_s", "publish_s")
GAPS = ("call_in_s", "answer_back_s")
TFT_PARTS = ("quorum_s", "delta_s", "allreduce_s", "restore_s", "should_commit_s", "outer_step_s", "save_s", "merge_s")


# ---- shared ---------------------------------------------------------------------------------


def _model(layers: int) -> Any:
    from diloco.model import build_model, model_config

    return build_model(model_config("tiny", n_layers=layers), 0)


def _batches(vocab: int, context: int, batch: int, n: int = 4) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        seq = torch.randint(0, vocab, (batch, context + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _wait_file(path: Path, timeout_s: float, procs: list[subprocess.Popen]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[2] if len(p.args) > 2 else p.args}: exited with {p.returncode} before writing {path.name}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def save_result(out: Path | None, result: Any) -> None:
    """The result file, its folder made (none without --out); says where it is."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, result)
    print(f"results: {out}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _run_children(cmds: list[tuple[str, list[str], dict[str, str]]], timeout_s: float, work: Path) -> None:
    """Starts every command (name, argv, env), waits for all; raises naming a failed one."""
    procs, logs = [], []
    try:
        for name, argv, env in cmds:
            log = open(work / f"{name}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [(c[0], p.returncode) for c, p in zip(cmds, procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"{failed[0][0]} exited with {failed[0][1]}" if failed else f"timed out after {timeout_s:.0f} s"
                tail = "".join((work / f"{(failed or [(cmds[0][0],)])[0][0]}.log").read_text().splitlines(True)[-30:])
                raise RuntimeError(f"{why}; its log ({work}) ends:\n{tail}")
            time.sleep(0.1)
        failed = [(c[0], p.returncode) for c, p in zip(cmds, procs) if p.returncode != 0]
        if failed:
            tail = "".join((work / f"{failed[0][0]}.log").read_text().splitlines(True)[-30:])
            raise RuntimeError(f"{failed[0][0]} exited with {failed[0][1]}; its log ends:\n{tail}")
    finally:
        _stop(procs)
        for log in logs:
            log.close()


def _late(round: int, replica: int) -> bool:
    """The replica made to arrive last in ``round``: they take turns."""
    return round % 2 == replica


# ---- ours -----------------------------------------------------------------------------------


def ours_coordinator(a: argparse.Namespace) -> None:
    import torch

    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.io import limit_malloc_arenas
    from diloco.outer import OuterConfig
    from diloco.transport import serve

    torch.set_num_threads(1)
    limit_malloc_arenas()
    if a.malloc_keep:
        _keep_freed_memory()
    theta = {n: p.detach().clone() for n, p in _model(a.layers).named_parameters()}
    work = Path(a.work)
    cfg = CoordinatorConfig(total_rounds=a.rounds, min_sites=2, max_sites=2, checkpoint_dir=None if a.no_checkpoint else str(work / "checkpoints"))
    coord = Coordinator(theta, OuterConfig(), cfg)
    server, port = serve(coord, "127.0.0.1", 0)
    stop_ticker = coord.start_ticker()
    try:
        _write(work / "port.json", {"port": port})
        if not coord.wait_all_left(a.timeout):
            raise SystemExit("the sites did not finish in time")
        _write(work / "coordinator.json", {"timings": coord.commit_timings(), "global_sha256": coord.global_sha256(), "rounds": coord.committed_rounds})
    finally:
        stop_ticker()
        server.stop(grace=1.0).wait(5)


def _keep_freed_memory() -> None:
    """--malloc-keep: glibc serves large blocks from its heap and keeps what is freed (no mmap
    per block, no trimming), so a commit's buffers reuse memory already mapped instead of
    faulting in fresh pages every round (a proposed setting for the coordinator process,
    beside diloco.io.limit_malloc_arenas)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def ours_site(a: argparse.Namespace) -> None:
    import torch

    from diloco.site.exchange import Timeouts
    from diloco.site.inner import InnerConfig, InnerTrainer
    from diloco.site.outer_sync import OuterSync, SyncOptions
    from diloco.transport import CoordinatorClient

    torch.set_num_threads(1)
    if a.site_bundles:
        _bundle_site_pushes()
    work = Path(a.work)
    port = _wait_file(work / "port.json", 60, [])["port"]
    model = _model(a.layers)
    cfg = model.cfg if hasattr(model, "cfg") else None
    vocab, context = (cfg.vocab_size, cfg.context) if cfg is not None else (256, 128)
    batches = _batches(vocab, context, a.batch)
    trainer = InnerTrainer(model, InnerConfig(), total_steps=a.rounds * a.H)
    me = a.replica
    rounds = []
    with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=120, connect_timeout_s=60) as real:
        client = _DelayedPulls(real, me, a.early_pull_delay) if a.early_pull_delay else real
        sync = OuterSync(
            model,
            client,
            str(me),
            SyncOptions.of(codec="fp32", every=a.H, timeouts=Timeouts(wait_poll_s=10.0, round_timeout_s=120.0, reconnect_timeout_s=30.0)),
        )
        try:
            sync.join()
            for r in range(a.rounds):
                loss = 0.0
                for i in range(a.H):
                    loss = trainer.step(*batches[i % len(batches)])
                if _late(r, me):
                    time.sleep(a.stagger)
                arrive = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
                t0 = time.perf_counter()
                sync.sync(tokens=a.batch * context * a.H, train_loss=loss, inner_steps=a.H)
                total = time.perf_counter() - t0
                parts = {k: v for k, v in sync.stats.timings[-1].items() if k in OURS_PARTS}
                pushed = arrive + parts["delta_s"] + parts["encode_s"] + parts["push_s"]
                rounds.append({"round": r, "arrive": arrive, "pushed": pushed, "total_s": total, **parts})
            digest = sync.global_sha256()
            sync.leave()
        finally:
            sync.close()
    _write(work / f"site{me}.json", {"rounds": rounds, "global_sha256": digest})


def _bundle_site_pushes() -> None:
    """--site-bundles: the site's push goes in bundles too (diloco.wire.bundle_chunks), as the
    coordinator's downlink does; a preview of that one-line change to OuterSync.begin (the
    coordinator already takes bundled pushes)."""
    import diloco.site.outer_sync as outer_sync
    from diloco.wire import MAX_CHUNK_BYTES, bundle_chunks

    plain = outer_sync.encode_chunks

    def bundled(*args: Any, **kwargs: Any) -> Any:
        return iter(bundle_chunks(list(plain(*args, **kwargs)), kwargs.get("chunk_bytes", MAX_CHUNK_BYTES)))

    outer_sync.encode_chunks = bundled  # type: ignore[attr-defined]


class _DelayedPulls:
    """A diagnostic (--early-pull-delay): the client of a site that is early this round waits
    before pulling the update, so that its pull does not overlap the late site's. It shows
    what the two pulls cost each other; the figures of record are taken without it."""

    def __init__(self, client: Any, me: int, delay_s: float) -> None:
        self._client, self._me, self._delay_s = client, me, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pull_update(self, site_id: str, round: int, want: Any = None) -> Any:
        if not _late(round, self._me):
            time.sleep(self._delay_s)
        return self._client.pull_update(site_id, round, want)


def _common_args(a: argparse.Namespace, work: Path) -> list[str]:
    """The arguments both sides' workers take."""
    return [
        "--layers",
        str(a.layers),
        "--H",
        str(a.H),
        "--rounds",
        str(a.rounds),
        "--batch",
        str(a.batch),
        "--stagger",
        str(a.stagger),
        "--work",
        str(work),
        "--timeout",
        str(a.timeout),
    ]


def run_ours(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    common = _common_args(a, work)
    if a.no_checkpoint:
        common.append("--no-checkpoint")
    if a.early_pull_delay:
        common += ["--early-pull-delay", str(a.early_pull_delay)]
    if a.site_bundles:
        common.append("--site-bundles")
    if a.malloc_keep:
        common.append("--malloc-keep")
    py = sys.executable
    cmds = [("coordinator", [py, str(SCRIPT), "_ours_coordinator", *common], {})]
    cmds += [(f"site{i}", [py, str(SCRIPT), "_ours_site", "--replica", str(i), *common], {}) for i in range(2)]
    _run_children(cmds, a.timeout, work)
    sites = [json.loads((work / f"site{i}.json").read_text()) for i in range(2)]
    coord = json.loads((work / "coordinator.json").read_text())
    commits = {t["round"]: t for t in coord["timings"]}
    per_round = []
    for r in range(a.rounds):
        s = [site["rounds"][r] for site in sites]
        last = max((0, 1), key=lambda i: s[i]["arrive"])
        other = s[1 - last]
        waited = max(0.0, other["pushed"] - s[last]["arrive"])
        c = commits.get(r, {})
        push_began = s[last]["arrive"] + s[last]["delta_s"] + s[last]["encode_s"]
        gaps = {}
        if "began_at" in c and "published_at" in c:
            # the push's way in (call set-up, its header) and, after the publication, the way
            # back of its answer: the time the site's push took outside the coordinator's _take
            gaps = {"call_in_s": c["began_at"] - push_began, "answer_back_s": push_began + s[last]["push_s"] - c["published_at"]}
        per_round.append({
            "round": r, "last": last, "closer": c.get("closer"), "waited_for_other_s": waited, "own_s": s[last]["total_s"] - waited,
            **{k: s[last][k] for k in ("total_s", *OURS_PARTS)}, "coordinator": {**{k: c.get(k) for k in COORD_PARTS}, **gaps},
        })  # fmt: skip
    hashes = {coord["global_sha256"], *(site["global_sha256"] for site in sites)}
    return {"per_round": per_round, "hashes_equal": len(hashes) == 1, "rounds_committed": coord["rounds"]}


# ---- torchft --------------------------------------------------------------------------------


def tft_lighthouse(a: argparse.Namespace) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    _write(Path(a.work) / "lighthouse.json", {"address": lighthouse.address()})
    try:
        while not (Path(a.work) / "done0").exists() or not (Path(a.work) / "done1").exists():
            time.sleep(0.2)
    finally:
        lighthouse.shutdown()


def tft_replica(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from diloco.model import lm_loss, model_logits

    torch.set_num_threads(1)
    work = Path(a.work)
    me = a.replica
    address = _wait_file(work / "lighthouse.json", 60, [])["address"]
    model = _model(a.layers)
    cfg = model.cfg if hasattr(model, "cfg") else None
    vocab, context = (cfg.vocab_size, cfg.context) if cfg is not None else (256, 128)
    batches = _batches(vocab, context, a.batch)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=2, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(me), store_addr="localhost", store_port=store.port, rank=0, world_size=1, lighthouse_addr=address, hostname="localhost",
        timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=30),
    )  # fmt: skip
    times: dict[str, float] = {}
    mark: dict[str, float] = {}

    def timed(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    def before_diloco(*_: Any) -> None:  # runs before DiLoCo's post-hook: the AdamW step is done
        mark["hook"] = time.perf_counter()
        mark["arrive"] = time.monotonic()

    inner.register_step_post_hook(before_diloco)
    rounds = []
    with DiLoCo(manager, [model], inner, outer, sync_every=a.H, use_bucketization=a.tft_bucketize) as diloco:
        frag = diloco._fragments[0]
        timed(manager, "start_quorum", "quorum_s")
        timed(frag, "_save_grads", "delta_s")
        timed(frag, "_average_grads", "allreduce_launch_s")
        timed(frag, "perform_sync", "perform_sync_s")
        timed(frag, "restore_parameters", "restore_s")
        timed(manager, "should_commit", "should_commit_s")
        timed(outer, "step", "outer_step_s")
        timed(frag, "save_parameters", "save_s")
        timed(frag, "_save_local_parameters", "merge_s")
        timed(frag, "_merge_parameters", "merge_s")
        for r in range(a.rounds):
            for i in range(a.H):
                loss = lm_loss(model_logits(model, batches[i % len(batches)][0]), batches[i % len(batches)][1])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if i == a.H - 1:
                    if _late(r, me):
                        time.sleep(a.stagger)
                    times.clear()
                inner.step()
                inner.zero_grad(set_to_none=True)
            total = time.perf_counter() - mark["hook"]
            inside = sum(times.get(k, 0.0) for k in ("restore_s", "should_commit_s", "outer_step_s", "save_s", "merge_s"))
            parts = {
                "quorum_s": times.get("quorum_s", 0.0), "delta_s": times.get("delta_s", 0.0),
                "allreduce_s": times.get("allreduce_launch_s", 0.0) + max(0.0, times.get("perform_sync_s", 0.0) - inside),
                **{k: times.get(k, 0.0) for k in ("restore_s", "should_commit_s", "outer_step_s", "save_s", "merge_s")},
            }  # fmt: skip
            rounds.append({"round": r, "arrive": mark["arrive"], "total_s": total, "step": manager.current_step(), **parts})
    digest = _sha256({n: p.detach() for n, p in model.named_parameters()})
    _write(work / f"replica{me}.json", {"rounds": rounds, "global_sha256": digest})
    (work / f"done{me}").touch()
    manager.shutdown(wait=False)


def _sha256(params: dict[str, Any]) -> str:
    """A hash of the parameters' bytes (torch.save of clones: this environment has no numpy)."""
    import hashlib
    import io

    import torch

    buf = io.BytesIO()
    torch.save({n: params[n].detach().clone().contiguous() for n in sorted(params)}, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def run_torchft(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    common = _common_args(a, work)
    py = a.torchft_python
    if a.tft_bucketize:
        common.append("--tft-bucketize")
    env = {"PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "TORCHFT_LIGHTHOUSE": "", "PYTHONWARNINGS": "ignore"}
    cmds = [("lighthouse", [py, str(SCRIPT), "_tft_lighthouse", *common], env)]
    cmds += [(f"replica{i}", [py, str(SCRIPT), "_tft_replica", "--replica", str(i), *common], env) for i in range(2)]
    _run_children(cmds, a.timeout, work)
    reps = [json.loads((work / f"replica{i}.json").read_text()) for i in range(2)]
    per_round = []
    for r in range(a.rounds):
        s = [rep["rounds"][r] for rep in reps]
        last = max((0, 1), key=lambda i: s[i]["arrive"])
        waited = max(0.0, s[1 - last]["arrive"] - s[last]["arrive"])
        per_round.append(
            {"round": r, "last": last, "waited_for_other_s": waited, "own_s": s[last]["total_s"] - waited, **{k: s[last][k] for k in ("total_s", *TFT_PARTS)}}
        )
    return {"per_round": per_round, "hashes_equal": reps[0]["global_sha256"] == reps[1]["global_sha256"], "steps": [rep["rounds"][-1]["step"] for rep in reps]}


# ---- the table ------------------------------------------------------------------------------


def _stats(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 5), "min": round(min(xs), 5), "max": round(max(xs), 5), "n": len(xs)}


def summarize(system: str, result: dict[str, Any], warmup: int) -> dict[str, Any]:
    rounds = [p for p in result["per_round"] if p["round"] >= warmup]
    keys = ["own_s", "total_s", "waited_for_other_s", *(OURS_PARTS if system == "ours" else TFT_PARTS)]
    out = {k: _stats([p[k] for p in rounds]) for k in keys}
    if system == "ours":
        out["closer_is_last"] = sum(1 for p in rounds if p["closer"] == str(p["last"]))
        for k in (*COORD_PARTS, *GAPS):
            out[f"coordinator.{k}"] = _stats([p["coordinator"].get(k) for p in rounds])
    return out


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    print(f"{'system':8} {'part':28} {'median s':>10} {'min s':>10} {'max s':>10}")
    for system, summary in summaries.items():
        for k, v in summary.items():
            if isinstance(v, dict):
                print(f"{system:8} {k:28} {v['median']:10.4f} {v['min']:10.4f} {v['max']:10.4f}")
        print()
    if "ours" in summaries and "torchft" in summaries:
        o, t = summaries["ours"]["own_s"]["median"], summaries["torchft"]["own_s"]["median"]
        print(f"the last replica's own sync cost, median: ours {o:.4f} s, torchft {t:.4f} s, ours / torchft = {o / t:.2f}x")


def _machine() -> dict[str, Any]:
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = None
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "loadavg_before": load, "python": sys.version.split()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--systems", default="ours,torchft", help="comma-separated: ours, torchft")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system, alternating; the figures pool their rounds")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny preset (4: 836,736 parameters)")
    p.add_argument("--H", type=int, default=20, help="inner steps per round")
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--warmup", type=int, default=2, help="first rounds left out of the figures")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--stagger", type=float, default=0.25, help="seconds the late replica sleeps after its inner phase")
    p.add_argument("--no-checkpoint", action="store_true", help="ours: no coordinator checkpoint (a real run writes one every round)")
    p.add_argument("--malloc-keep", action="store_true", help="ours: the coordinator process keeps freed memory (glibc mallopt; a proposed setting)")
    p.add_argument("--site-bundles", action="store_true", help="ours: the sites bundle their pushes too (a preview of a change to diloco/site)")
    p.add_argument("--early-pull-delay", type=float, default=0.0, help="diagnostic: the early site waits this long before pulling (0: no)")
    p.add_argument(
        "--tft-bucketize", action="store_true", help="torchft: one allreduce for all parameters (use_bucketization=True; its default is one per parameter)"
    )
    p.add_argument("--torchft-python", default="/tmp/tftvenv/bin/python")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    roles = {"_ours_coordinator": ours_coordinator, "_ours_site": ours_site, "_tft_lighthouse": tft_lighthouse, "_tft_replica": tft_replica}
    if a.role in roles:
        roles[a.role](a)
        return
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        if s not in ("ours", "torchft"):
            raise SystemExit(f"--systems: unknown system {s!r} (ours, torchft)")
    result: dict[str, Any] = {
        "bench": "sync",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k not in ("role", "work", "replica")},
        "machine": _machine(),
    }
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="bench_sync_", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        for rep in range(a.repeats):
            for s in systems:
                t0 = time.monotonic()
                run = (run_ours if s == "ours" else run_torchft)(a, Path(tmp) / f"{s}{rep}")
                run["wall_s"] = round(time.monotonic() - t0, 2)
                runs[s].append(run)
                print(f"{s} run {rep}: {run['wall_s']} s, hashes equal: {run['hashes_equal']}", flush=True)
    summaries = {}
    for s in systems:
        pooled = {"per_round": [p for run in runs[s] for p in run["per_round"]]}
        summaries[s] = summarize(s, pooled, a.warmup)
    result["runs"] = runs
    result["summary"] = summaries
    print_table(summaries)
    save_result(a.out, result)


if __name__ == "__main__":
    main()
