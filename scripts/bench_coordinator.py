"""The coordinator's data plane, measured: synthetic sites push pre-encoded pseudo-gradients
through real gRPC into the real coordinator process, and pull each round's update; no training.

* The coordinator: ``diloco-coordinator`` itself (``diloco.cli.coordinator.main`` with hydra
  overrides, in its own OS process, ``--coordinator-pythonpath`` choosing the tree) with
  ``init=file`` on a safetensors file of synthetic θ (``--params`` float32 parameters: square
  2048 x 2048 matrices of 4.2 M each, a 2048-vector beside each, one flat tail), ``sites=N``,
  ``coordinator.min_sites=N`` (with ``quorum.deadline=none`` every round waits for all N),
  ``eval_by=sites``, and a checkpoint after every round as diloco-sim's coordinator writes
  (``--no-checkpoint``: none). Its launcher (``_coordinator`` below) imports the CLI, notes the
  process's memory then (the baseline: interpreter and imports, before θ is read), hands the
  overrides to the CLI's ``main`` unchanged, and keeps a reference to the ``Coordinator`` (the
  CLI's own ``attach`` hook) to write its ``commit_timings()`` once it has served.
* The sites: N OS processes of this tree, each a ``CoordinatorClient`` doing what a site's
  ``OuterSync`` does: Join, its first pull of θ at the start barrier (of one small tensor,
  not the whole θ: that pull is not measured), heartbeats, then every round
  ``diloco.site.exchange.exchange``: the push (the round's chunks, as ``encode_chunks`` makes
  them, 1 MiB each), the pull sent behind its last chunk and held until the commit, the update
  drained (``--decode``: decoded into tensors, never applied). The bench encodes ``--deltas``
  random Δ once per codec before any round (site i pushes Δ i mod K) into files the sites map
  read-only, so a site holds no copy of its own.

Per round: its wall time (the sites' clocks: the first push's start to the last pull's end;
beside it the coordinator's own records: metrics.jsonl's wall_s, opening to commit, and
``commit_timings()``'s parts); the coordinator's CPU seconds over the same span (utime+stime
of /proc/<pid>/stat, all its threads, sampled every 20 ms and interpolated); and, over the run,
its peak memory (VmHWM) minus the baseline (VmRSS after imports). Derived: parameters pushed
(N x P per round) per coordinator CPU-second and per wall second. The first ``--warmup``
rounds are left out of the figures; medians, min and max over the ``--rounds`` after them.

Beside them, ceilings of this machine: memcpy (a float32 copy in one process, torch with one
thread) and gRPC loopback (a bare grpcio server, generic handler, raw bytes, one client-
streaming call of 1 MiB messages from a client in another process: bytes/s of wall time, and
the server process's CPU seconds per GB).

    .venv/bin/python scripts/bench_coordinator.py rates --out runs/bench_coordinator/rates.json
    .venv/bin/python scripts/bench_coordinator.py sites --out runs/bench_coordinator/sites.json
    .venv/bin/python scripts/bench_coordinator.py intake --rounds 4 --out runs/bench_coordinator/intake.json
    .venv/bin/python scripts/bench_coordinator.py rates --params 5e6 --codecs fp32,int8 --sites 2
    .venv/bin/python scripts/bench_coordinator.py sites --params 5e6 --sites-list 1,2,4
    .venv/bin/python scripts/bench_coordinator.py rates --coordinator-pythonpath /path/to/older/checkout

``rates``: each codec of ``--codecs`` at ``--params`` (default 50M) with ``--sites`` (4).
``intake``: the data path alone, in one process on one core, no gRPC and no commit: each push
is the wire bytes a site sends, parsed by the server's deserializer and taken by
``Coordinator.push`` (check, decode or keep, add); parameters per second per push, per codec,
beside memcpy (``--coordinator-pythonpath`` picks the tree here too).
``sites``: ``--codec`` (int8) at ``--params`` (100M) for each N of ``--sites-list``
(1,2,4,8,16,32). Prints a table and writes everything, per round, to ``--out`` (JSON), with
the machine (cores, CPU model, load average at the start, torch and grpcio versions, the git
commit of each tree). Every process it starts is killed on any way out. On a shared or small
machine the sites' own CPU competes with the coordinator's: its CPU seconds are its own, the
wall times are not.
"""

from __future__ import annotations

import argparse
import bisect
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync import _stats, _write, save_result  # noqa: E402  (the same result files and figures)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
WIDTH = 2048  # θ's matrices are WIDTH x WIDTH (4.2 M parameters), each with a WIDTH-vector
COMMIT_PARTS = ("receive_s", "mean_s", "step_s", "encode_s", "commit_s", "serve_s", "checkpoint_s", "publish_s")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- small helpers ---------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _status_kb(pid: int | str = "self", keys: tuple[str, ...] = ("VmRSS", "VmHWM", "RssAnon", "RssFile")) -> dict[str, int]:
    """Lines of /proc/<pid>/status, in KiB ({} once the process is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def _cpu_s(pid: int) -> float | None:
    """utime + stime of the process (all its threads), seconds; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


class Sampler:
    """The CPU seconds of one process, sampled every ``period_s`` on a thread of the bench."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid, self.period_s = pid, period_s
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.hwm_kb = 0
        self.rss: list[tuple[float, int]] = []  # (monotonic, VmRSS KiB), every 10th sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            c = _cpu_s(self.pid)
            if c is None:
                return
            self.times.append(time.monotonic())
            self.cpu.append(c)
            if n % 10 == 0:
                kb = _status_kb(self.pid)
                self.hwm_kb = max(self.hwm_kb, kb.get("VmHWM", 0))
                self.rss.append((self.times[-1], kb.get("VmRSS", 0)))
            n += 1
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def rss_mib_before(self, t: float) -> float | None:
        """The last VmRSS sampled at or before ``t``, MiB."""
        i = bisect.bisect_right(self.rss, (t, 1 << 62))
        return self.rss[i - 1][1] / 1024 if i else None

    def at(self, t: float) -> float | None:
        """CPU seconds at monotonic time ``t``, interpolated between the samples around it."""
        i = bisect.bisect_left(self.times, t)
        if not self.times or i == 0 and t < self.times[0] or i >= len(self.times):
            return None
        if self.times[i] == t:
            return self.cpu[i]
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


class Procs:
    """Child processes, each in its own session (a group to kill), each logging to a file."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.items: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.work / f"{name}.log", "wb") as log:
            p = subprocess.Popen(
                argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        self.items.append((name, p))
        return p

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "".join((self.work / f"{name}.log").read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def check(self) -> None:
        """Raises naming the first child that exited with an error, with its log's end."""
        for name, p in self.items:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{name} exited with {p.returncode}; its log ({self.work / name}.log) ends:\n{self.tail(name)}")

    def wait_for(self, ready: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (logs in {self.work})")
            time.sleep(0.05)

    def kill_all(self) -> None:
        for _, p in self.items:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _, p in self.items:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _interrupted(signum: int, _frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def _die_with_parent() -> None:
    """A child of the bench is killed when the bench dies, however it dies (PR_SET_PDEATHSIG)."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent == 1 or os.getppid() != parent:
        os._exit(1)


# ---- synthetic θ and Δ -----------------------------------------------------------------------


def theta_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of P parameters, transformer-like: WIDTH x WIDTH matrices with a
    WIDTH-vector (a norm's gain) each, and a flat tail for the rest."""
    shapes: dict[str, tuple[int, ...]] = {}
    left, i = params, 0
    while left >= WIDTH * WIDTH + WIDTH:
        shapes[f"layers.{i:03d}.weight"] = (WIDTH, WIDTH)
        shapes[f"layers.{i:03d}.norm"] = (WIDTH,)
        left -= WIDTH * WIDTH + WIDTH
        i += 1
    if left:
        shapes["tail"] = (left,)
    return shapes


def write_theta(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=g).mul_(0.02) for n, s in shapes.items()}, str(path))


def encode_deltas(work: Path, shapes: dict[str, tuple[int, ...]], codec_name: str, count: int) -> list[Path]:
    """``count`` random Δ, each encoded once with the run's codec (conf/codec's defaults) into
    ``delta_<codec>_<k>.bin`` (the payloads) and ``.json`` (the chunks' headers)."""
    import dataclasses

    import torch

    from diloco.codec import codec_config
    from diloco.wire import MAX_CHUNK_BYTES, encode_chunks

    cfg = codec_config(codec_name)
    codec = cfg.build()
    out = []
    for k in range(count):
        g = torch.Generator().manual_seed(1000 + k)
        delta = {n: torch.randn(s, generator=g).mul_(1e-3) for n, s in shapes.items()}
        base = work / f"delta_{codec_name}_{k}"
        entries, pos = [], 0
        with open(base.with_suffix(".bin"), "wb") as f:
            for c in encode_chunks(delta, codec=codec, chunk_bytes=MAX_CHUNK_BYTES):
                f.write(c.payload)
                entries.append([c.name, list(c.shape), c.dtype, c.offset, c.numel, c.codec, pos, len(c.payload)])
                pos += len(c.payload)
        _write(base.with_suffix(".json"), {"codec": dataclasses.asdict(cfg), "specs": {n: list(s) for n, s in shapes.items()}, "chunks": entries, "bytes": pos})
        out.append(base)
        del delta
    return out


# ---- the coordinator process -----------------------------------------------------------------


def role_coordinator(argv: list[str]) -> None:
    """``_coordinator --baseline F --timings F -- OVERRIDES``: diloco-coordinator OVERRIDES, of
    the tree on PYTHONPATH, after noting the memory of the interpreter and its imports."""
    cut = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--timings", type=Path, required=True)
    a = p.parse_args(argv[:cut])
    import inspect

    import diloco.cli.coordinator as cli

    _write(a.baseline, {"pid": os.getpid(), "t": time.monotonic(), "cpu_s": _cpu_s(os.getpid()), **_status_kb(), "diloco": cli.__file__})
    run = cli.run_coordinator
    if "attach" in inspect.signature(run).parameters:  # an older tree may not take it: no commit timings then
        held: list[Any] = []

        def run_keeping(*args: Any, **kwargs: Any) -> Any:
            try:
                return run(*args, **kwargs, attach=held.append)
            finally:
                if held and hasattr(held[0], "commit_timings"):
                    _write(a.timings, held[0].commit_timings())

        cli.run_coordinator = run_keeping  # type: ignore[assignment]
    sys.argv = ["diloco-coordinator", *argv[cut + 1 :]]
    cli.main()


# ---- a site process --------------------------------------------------------------------------


class _MappedChunks:
    """A pre-encoded push, its payloads read from a shared read-only map as each is sent."""

    def __init__(self, entries: list[list[Any]], data: mmap.mmap) -> None:
        self.entries, self.data = entries, data

    def __iter__(self) -> Any:
        from diloco.types import Chunk

        for name, shape, dtype, offset, numel, codec, pos, size in self.entries:
            yield Chunk(name=name, shape=tuple(shape), dtype=dtype, offset=offset, numel=numel, codec=codec, payload=self.data[pos : pos + size])


class _Drain:
    """An assembler that keeps nothing: the update's payload bytes, counted."""

    def __init__(self) -> None:
        self.payload_bytes = 0

    def add(self, chunk: Any) -> None:
        from diloco.wire import inner_payload_bytes

        self.payload_bytes += inner_payload_bytes([chunk])

    def finish(self) -> dict[str, Any]:
        return {}


def role_site(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--delta", type=Path, required=True)
    p.add_argument("--decode", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    from diloco.boxes import Box
    from diloco.codec import codec_config
    from diloco.site.exchange import Timeouts, exchange
    from diloco.site.heartbeat import Heartbeat
    from diloco.site.stats import SyncStats
    from diloco.sync import RunSettings
    from diloco.transport import CoordinatorClient
    from diloco.types import JoinRequest, PushHeader, TensorSpec
    from diloco.wire import ChunkAssembler

    work, sid = a.work, a.id
    index = json.loads(a.delta.with_suffix(".json").read_text())
    specs = {n: TensorSpec(n, tuple(s), "float32") for n, s in index["specs"].items()}
    with open(a.delta.with_suffix(".bin"), "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    chunks = _MappedChunks(index["chunks"], data)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    imported = _status_kb()
    _write(work / f"site{sid}.ready", {"pid": os.getpid()})
    deadline = time.monotonic() + a.timeout
    while (go := _read_json(work / "go.json")) is None:
        if time.monotonic() > deadline:
            raise SystemExit("no go.json from the bench")
        time.sleep(0.05)
    timeouts = Timeouts(wait_poll_s=30.0, round_timeout_s=a.timeout, reconnect_timeout_s=60.0)
    new_assembler = (lambda: ChunkAssembler(specs)) if a.decode else _Drain
    with CoordinatorClient(go["address"], timeout_s=a.timeout, connect_timeout_s=60.0) as client:
        info = client.join(JoinRequest(sid, tuple(specs.values()), can_upload=False))
        run_codec = RunSettings.from_dict(info.settings).codec.describe() if info.settings is not None else None
        if run_codec != codec_config(index["codec"]).describe():  # each parameter in effect
            raise SystemExit(f"site {sid}: the run's codec is {run_codec}, the pushes were encoded with {codec_config(index['codec']).describe()}")
        beat = Heartbeat(client, sid, info.lease_s / 3, log) if info.lease_s > 0 else None
        smallest = min(specs.values(), key=lambda s: (len(s.shape), s.shape))
        status, _ = client.pull_global(sid, {smallest.name: Box.whole(smallest.shape)})  # the start barrier
        if status.committed_rounds != 0:
            raise SystemExit(f"site {sid}: the run is at round {status.committed_rounds}, not 0 (a checkpoint left in the run directory?)")
        stats, rounds = SyncStats(), []
        for r in range(info.total_rounds):
            header = PushHeader(site_id=sid, round=r, tokens=1000, train_loss=1.0, inner_steps=1)
            times: dict[str, float] = {"push_s": 0.0, "wait_s": 0.0, "pull_s": 0.0}
            start = time.monotonic()
            outcome, update = exchange(client, [(header, chunks)], [None], new_assembler, timeouts, stats, times, log)  # type: ignore[list-item]
            end = time.monotonic()
            if not outcome.applied or outcome.refused or update is None:
                raise SystemExit(f"site {sid}: round {r} did not go through: {outcome}")
            rounds.append({"round": r, "start": start, "end": end, **times, "bytes_down": update.payload_bytes})
        if beat is not None:
            beat.stop()
        _write(work / f"site{sid}.json", {"rounds": rounds, "imported_kb": imported, "end_kb": _status_kb(), "reconnects": stats.reconnects})
        deadline = time.monotonic() + a.timeout
        while not (work / "leave").exists():
            if time.monotonic() > deadline:
                raise SystemExit("no word to leave from the bench")
            time.sleep(0.05)
        client.leave(sid, "")


# ---- one configuration -----------------------------------------------------------------------


def run_config(a: argparse.Namespace, codec: str, n: int, theta: Path, deltas: list[Path], params: int, work: Path) -> dict[str, Any]:
    """One coordinator and ``n`` sites for ``a.warmup + a.rounds`` rounds; its figures."""
    d = work / f"{codec}_{n}sites"
    d.mkdir(parents=True)
    sampler, seen = _run_processes(a, codec, n, theta, deltas, d)
    shutil.rmtree(d / "checkpoints", ignore_errors=True)  # θ and momentum twice over: the disk's, not the figures'
    return _figures(a, codec, n, params, d, sampler, seen)


def _run_processes(a: argparse.Namespace, codec: str, n: int, theta: Path, deltas: list[Path], d: Path) -> tuple[Sampler, dict[str, Any]]:
    """Starts the coordinator and the sites together, lets the sites go once all are up, and
    reads the coordinator's /proc after the last round, before the sites leave."""
    py = sys.executable
    overrides = [
        "init=file", f"init.path={theta}", f"sites={n}", f"rounds={a.warmup + a.rounds}", f"codec={codec}", "eval_by=sites",
        "coordinator.host=127.0.0.1", "coordinator.port=0", f"coordinator.port_file={d / 'port.json'}", f"coordinator.min_sites={n}",
        f"hydra.run.dir={d / 'coord'}", *([] if a.no_checkpoint else [f"coordinator.checkpoint_dir={d / 'checkpoints'}"]),
        *([f"coordinator.shards={a.shards}"] if getattr(a, "shards", 1) > 1 else []), *a.override,
    ]  # fmt: skip
    procs = Procs(d)
    sampler: Sampler | None = None
    try:
        coord = procs.start(
            "coordinator",
            [py, str(SCRIPT), "_coordinator", "--baseline", str(d / "baseline.json"), "--timings", str(d / "timings.json"), "--", *overrides],
            {"PYTHONPATH": str(a.coordinator_pythonpath)},
        )
        sampler = Sampler(coord.pid)
        for i in range(n):
            site = [py, str(SCRIPT), "_site", "--work", str(d), "--id", str(i), "--delta", str(deltas[i % len(deltas)]), "--timeout", str(a.timeout)]
            procs.start(f"site{i}", site + (["--decode"] if a.decode else []), {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        procs.wait_for(lambda: (d / "port.json").exists(), a.timeout, "the coordinator's port file")
        procs.wait_for(lambda: all((d / f"site{i}.ready").exists() for i in range(n)), a.timeout, "the sites' start")
        seen: dict[str, Any] = {"go": time.monotonic(), "at_start": _status_kb(coord.pid)}  # θ read, the server up, no round yet
        _write(d / "go.json", {"address": f"127.0.0.1:{json.loads((d / 'port.json').read_text())['port']}"})
        procs.wait_for(lambda: all((d / f"site{i}.json").exists() for i in range(n)), a.timeout, "the sites' rounds")
        seen["at_end"] = _status_kb(coord.pid)
        (d / "leave").touch()
        procs.wait_for(lambda: coord.poll() is not None, 120, "the coordinator's exit")
        procs.check()
        return sampler, seen
    finally:
        if sampler is not None:
            sampler.stop()
        procs.kill_all()


def _figures(a: argparse.Namespace, codec: str, n: int, params: int, d: Path, sampler: Sampler, seen: dict[str, Any]) -> dict[str, Any]:
    sites = [json.loads((d / f"site{i}.json").read_text()) for i in range(n)]
    baseline = json.loads((d / "baseline.json").read_text())
    commits = {t["round"]: t for t in _read_json(d / "timings.json") or []}
    lines = {m["round"]: m for m in (json.loads(x) for x in (d / "coord" / "metrics.jsonl").read_text().splitlines() if x.strip())}

    def cpu_between(t0: float, t1: float) -> float | None:
        c0, c1 = sampler.at(t0), sampler.at(t1)
        return None if c0 is None or c1 is None else c1 - c0

    per_round = []
    for r in range(a.warmup + a.rounds):
        s = [site["rounds"][r] for site in sites]
        start, end = min(x["start"] for x in s), max(x["end"] for x in s)
        wall, cpu, c, line = end - start, cpu_between(start, end), commits.get(r, {}), lines.get(r, {})
        per_round.append({
            "round": r, "round_s": wall, "cpu_s": cpu, "cores": cpu / wall if cpu is not None else None,
            "params_per_cpu_s": n * params / cpu if cpu else None, "params_per_wall_s": n * params / wall, "coordinator_rss_mib": sampler.rss_mib_before(end),
            "push_s_max": max(x["push_s"] for x in s), "wait_s_median": statistics.median(x["wait_s"] for x in s), "pull_s_max": max(x["pull_s"] for x in s),
            "bytes_up": line.get("bytes_up"), "bytes_down": sum(x["bytes_down"] for x in s),
            "coordinator": {"open_to_commit_s": line.get("wall_s"), "elapsed_s": line.get("elapsed_s"), **{k: c.get(k) for k in COMMIT_PARTS}},
        })  # fmt: skip
    measured = [p for p in per_round if p["round"] >= a.warmup]
    cpu_all = cpu_between(min(site["rounds"][a.warmup]["start"] for site in sites), max(site["rounds"][-1]["end"] for site in sites))
    summary: dict[str, Any] = {
        k: _stats([p[k] for p in measured])
        for k in ("round_s", "cpu_s", "cores", "params_per_cpu_s", "params_per_wall_s", "push_s_max", "wait_s_median", "pull_s_max")
    }
    summary.update({f"coordinator.{k}": _stats([p["coordinator"][k] for p in measured]) for k in ("open_to_commit_s", *COMMIT_PARTS)})
    summary["cpu_s_per_round_overall"] = cpu_all / len(measured) if cpu_all is not None else None
    summary["params_per_cpu_s_overall"] = n * params * len(measured) / cpu_all if cpu_all else None
    ups = [p["bytes_up"] / n for p in measured if p["bytes_up"]]
    summary["bytes_up_per_site"] = statistics.median(ups) if ups else None
    summary["bytes_down_per_site"] = statistics.median(p["bytes_down"] / n for p in measured)
    mib = 1024.0
    peak = max(seen["at_end"].get("VmHWM", 0), sampler.hwm_kb)
    memory = {
        "baseline_rss_mib": baseline["VmRSS"] / mib, "baseline_rss_anon_mib": baseline.get("RssAnon", 0) / mib,
        "rss_at_start_mib": seen["at_start"].get("VmRSS", 0) / mib, "peak_hwm_mib": peak / mib, "rss_end_mib": seen["at_end"].get("VmRSS", 0) / mib,
        "peak_above_baseline_mib": (peak - baseline["VmRSS"]) / mib, "theta_mib": params * 4 / 2**20,
        "site_rss_after_imports_mib": _stats([s["imported_kb"].get("VmRSS", 0) / mib for s in sites]),
        "site_rss_anon_after_imports_mib": _stats([s["imported_kb"].get("RssAnon", 0) / mib for s in sites]),
        "site_peak_hwm_mib": _stats([s["end_kb"].get("VmHWM", 0) / mib for s in sites]),
        "site_rss_anon_end_mib": _stats([s["end_kb"].get("RssAnon", 0) / mib for s in sites]),
    }  # fmt: skip
    return {
        "codec": codec, "sites": n, "params": params, "rounds": a.warmup + a.rounds, "warmup": a.warmup, "checkpoint": not a.no_checkpoint,
        "start_s": min(site["rounds"][0]["start"] for site in sites) - seen["go"], "coordinator_tree": baseline.get("diloco"),
        "memory": memory, "summary": summary, "per_round": per_round, "coordinator_global": _read_json(d / "coord" / "global.json"),
        "sites_reconnects": sum(s["reconnects"] for s in sites),
    }  # fmt: skip


# ---- the data path in process ------------------------------------------------------------------


def role_intake(argv: list[str]) -> None:
    """In this process (the tree on PYTHONPATH), one core: ``--sites`` pushes of one Δ encoded
    with ``--codec`` into a real ``Coordinator`` whose round waits for more sites than push, so
    no commit runs; each push is the wire bytes a site sends (one PushMessage per chunk, as
    SerializeToString writes it), parsed by the server's own ``push_message_from_wire`` and
    taken by ``Coordinator.push``: parse, check, decode (or keep) and add into the round's sum.
    Prints one JSON line: the seconds of each push."""
    import torch

    from diloco.codec import get_codec
    from diloco.coordinator import Coordinator
    from diloco.coordinator.config import CoordinatorConfig
    from diloco.outer import OuterConfig
    from diloco.transport import serde
    from diloco.transport.pb import coordinator_pb2 as pb
    from diloco.types import JoinRequest, PushHeader
    from diloco.wire import encode_chunks, fingerprint

    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--codec", required=True)
    p.add_argument("--sites", type=int, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    theta = {n: torch.randn(s, generator=g) for n, s in theta_shapes(a.params).items()}
    delta = {n: t.mul(1e-3) for n, t in theta.items()}
    wire = [pb.PushMessage(chunk=serde.chunk_to_proto(c)).SerializeToString() for c in encode_chunks(delta, codec=get_codec(a.codec))]
    del delta
    coord = Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=2, min_sites=a.sites + 1))
    specs = tuple(fingerprint(theta).values())
    sites = [f"s{i}" for i in range(a.sites + 1)]
    for site in sites:
        coord.join(JoinRequest(site, specs))
    secs = []
    for site in sites[:-1]:
        t = time.perf_counter()
        coord.push(PushHeader(site_id=site, round=0, tokens=1000, train_loss=1.0, inner_steps=1), (serde.push_message_from_wire(m) for m in wire))
        secs.append(time.perf_counter() - t)
    print(json.dumps({"push_s": secs, "payload_bytes": sum(len(m) for m in wire)}), flush=True)


def intake_rates(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for codec in a.codecs.split(","):
        cmd = [sys.executable, str(SCRIPT), "_intake", "--params", str(a.params), "--codec", codec, "--sites", str(a.warmup + a.rounds)]
        env = {**os.environ, "PYTHONPATH": str(a.coordinator_pythonpath)}
        got = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=a.timeout).stdout.strip().splitlines()[-1])
        secs = got["push_s"][a.warmup :]
        s = statistics.median(secs)
        out.append({"codec": codec, "params": a.params, "push_s": secs, "median_s": s, "params_per_s": a.params / s, "wire_bytes": got["payload_bytes"]})
        print(f"intake {codec}: {a.params / s / 1e6:.0f} M params/s per push (median of {len(secs)}: {s:.4f} s)", flush=True)
    return out


# ---- the ceilings ----------------------------------------------------------------------------


def memcpy_ceiling(numel: int, repeats: int) -> dict[str, Any]:
    """dst.copy_(src) of ``numel`` float32, torch with one thread, in this process."""
    import torch

    torch.set_num_threads(1)
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages faulted in
    secs = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        secs.append(time.perf_counter() - t)
    del src, dst
    s = statistics.median(secs)
    return {"numel": numel, "seconds": secs, "params_per_s": numel / s, "gb_per_s": numel * 4 / s / 1e9, "threads": 1}


def role_grpc_server(argv: list[str]) -> None:
    """A bare grpcio server: one client-streaming method of raw bytes, answering with its
    process's CPU seconds (all threads) and the bytes it took."""
    from concurrent import futures

    import grpc

    p = argparse.ArgumentParser()
    p.add_argument("--port-file", type=Path, required=True)
    a = p.parse_args(argv)

    def take(messages: Any, _context: Any) -> bytes:
        c0, got, count = time.process_time(), 0, 0
        for m in messages:
            got += len(m)
            count += 1
        return json.dumps({"cpu_s": time.process_time() - c0, "bytes": got, "messages": count}).encode()

    handler = grpc.method_handlers_generic_handler("bench.Loopback", {"Take": grpc.stream_unary_rpc_method_handler(take)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 4 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _write(a.port_file, {"port": port})
    server.wait_for_termination()


def role_grpc_client(argv: list[str]) -> None:
    import grpc

    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    message = os.urandom(1 << 20)
    with grpc.insecure_channel(a.address, options=[("grpc.max_send_message_length", 4 << 20)]) as channel:
        take = channel.stream_unary("/bench.Loopback/Take")
        streams = []
        for i in range(a.repeats + 1):  # the first: connection and warm-up, left out
            t = time.perf_counter()
            answer = json.loads(take(iter([message] * a.mib), timeout=600, wait_for_ready=True))
            streams.append({"wall_s": time.perf_counter() - t, **answer, "warmup": i == 0})
    _write(a.out, streams)


def grpc_ceiling(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    d = work / "grpc_loopback"
    d.mkdir(parents=True)
    procs = Procs(d)
    py = sys.executable
    try:
        procs.start("server", [py, str(SCRIPT), "_grpc_server", "--port-file", str(d / "port.json")], {})
        procs.wait_for(lambda: (d / "port.json").exists(), 120, "the gRPC server's port file")
        port = json.loads((d / "port.json").read_text())["port"]
        client = [py, str(SCRIPT), "_grpc_client", "--address", f"127.0.0.1:{port}", "--mib", str(a.grpc_mib), "--repeats", str(a.rounds)]
        procs.start("client", [*client, "--out", str(d / "client.json")], {})
        procs.wait_for(lambda: (d / "client.json").exists(), a.timeout, "the gRPC client")
    finally:
        procs.kill_all()
    streams = json.loads((d / "client.json").read_text())
    kept = [s for s in streams if not s["warmup"]]
    return {
        "message_bytes": 1 << 20, "stream_bytes": a.grpc_mib << 20, "streams": streams,
        "bytes_per_s": _stats([s["bytes"] / s["wall_s"] for s in kept]), "server_cpu_s_per_gb": _stats([s["cpu_s"] / (s["bytes"] / 1e9) for s in kept]),
    }  # fmt: skip


# ---- the machine, the table, main --------------------------------------------------------------


def _git(tree: Path) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        r = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"tree": str(tree), "commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def machine(a: argparse.Namespace) -> dict[str, Any]:
    import grpc
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), None)
    return {
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "cpu_model": model, "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
        "mem_total_kb": int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]),
        "python": sys.version.split()[0], "torch": torch.__version__, "grpcio": grpc.__version__,
        "sites_tree": _git(ROOT), "coordinator_tree": _git(a.coordinator_pythonpath),
    }  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    def fmt(s: dict[str, float] | None, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if s is None else f"{s['median'] / scale:.{digits}f} [{s['min'] / scale:.{digits}f}, {s['max'] / scale:.{digits}f}]"

    print(
        f"{'codec':9} {'sites':>5} {'params':>7}  {'round s: median [min, max]':28} {'coord CPU s/round':26} {'cores':>5} {'Mparam/CPU-s':>12} {'Mparam/wall-s':>13} {'peak-base MiB':>13} {'MB up/site':>10} {'MB down/site':>12}"
    )
    for c in result["configs"]:
        s, m = c["summary"], c["memory"]
        up, down = s["bytes_up_per_site"], s["bytes_down_per_site"]
        print(
            f"{c['codec']:9} {c['sites']:5d} {c['params'] / 1e6:6.1f}M  {fmt(s['round_s']):28} {fmt(s['cpu_s']):26} {s['cores']['median'] if s['cores'] else float('nan'):5.2f} "
            f"{(s['params_per_cpu_s'] or {'median': float('nan')})['median'] / 1e6:12.1f} {s['params_per_wall_s']['median'] / 1e6:13.1f} {m['peak_above_baseline_mib']:13.0f} "
            f"{(up or 0) / 1e6:10.2f} {(down or 0) / 1e6:12.2f}"
        )  # fmt: skip
    print()
    for c in result["configs"]:
        s = c["summary"]
        parts = "  ".join(f"{k.removeprefix('coordinator.')} {s[k]['median']:.4f}" for k in s if k.startswith("coordinator.") and s[k])
        print(f"{c['codec']:9} {c['sites']:5d}  coordinator (median s): {parts}")
        m = c["memory"]
        print(
            f"{'':15}  memory MiB: baseline {m['baseline_rss_mib']:.0f}, peak {m['peak_hwm_mib']:.0f} (θ alone {m['theta_mib']:.0f}); a site: "
            f"after imports {m['site_rss_after_imports_mib']['median']:.0f} (anon {m['site_rss_anon_after_imports_mib']['median']:.0f}), peak {m['site_peak_hwm_mib']['max']:.0f}"
        )  # fmt: skip
    ceil = result.get("ceilings") or {}
    if "memcpy" in ceil:
        mc = ceil["memcpy"]
        print(f"\nceiling memcpy (torch, 1 thread, {mc['numel'] / 1e6:.0f}M float32): {mc['params_per_s'] / 1e6:.0f} Mparam/s, {mc['gb_per_s']:.2f} GB/s")
    if "grpc" in ceil:
        g = ceil["grpc"]
        print(
            f"ceiling gRPC loopback (1 stream, 1 MiB messages, {g['stream_bytes'] >> 20} MiB a stream): {g['bytes_per_s']['median'] / 1e9:.2f} GB/s "
            f"[{g['bytes_per_s']['min'] / 1e9:.2f}, {g['bytes_per_s']['max'] / 1e9:.2f}], server CPU {g['server_cpu_s_per_gb']['median']:.3f} s/GB"
        )


def _params(text: str) -> int:
    v = int(float(text))
    if v < WIDTH:
        raise argparse.ArgumentTypeError(f"{text}: at least {WIDTH} parameters")
    return v


def parse(argv: list[str]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    common.add_argument("--warmup", type=int, default=1, help="first rounds left out of the figures (default 1)")
    common.add_argument("--deltas", type=int, default=4, help="distinct random Δ per codec; site i pushes Δ i mod K (default 4)")
    common.add_argument("--no-checkpoint", action="store_true", help="the coordinator writes no checkpoint (default: one after every round)")
    common.add_argument("--decode", action="store_true", help="the sites decode each pulled update into tensors (default: drained, not decoded)")
    common.add_argument("--no-ceilings", action="store_true", help="skip the memcpy and gRPC loopback ceilings")
    common.add_argument("--memcpy-params", type=_params, default=64 << 20, help="float32 elements copied for the memcpy ceiling (default 64Mi)")
    common.add_argument("--grpc-mib", type=int, default=256, help="MiB per stream for the gRPC ceiling (default 256)")
    common.add_argument("--coordinator-pythonpath", type=Path, default=ROOT, help="the tree the coordinator runs from (PYTHONPATH; default this one)")
    common.add_argument("--override", action="append", default=[], help="one more hydra override for the coordinator (repeatable)")
    common.add_argument("--timeout", type=float, default=900.0, help="seconds any one stage may take")
    common.add_argument("--work", type=Path, default=None, help="keep the run's files in a new folder under this one (default: a temporary folder, removed)")
    common.add_argument("--out", type=Path, default=None, help="the JSON result file")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("rates", parents=[common], help="params/s per coordinator core and round time, per codec")
    r.add_argument("--codecs", default="fp32,int8,int4,topk2bit")
    r.add_argument("--params", type=_params, default=50_000_000, help="parameters of θ (default 50M; 5e6 for a quick run)")
    r.add_argument("--sites", type=int, default=4)
    i = sub.add_parser("intake", parents=[common], help="the data path per push in process (parse, check, add), per codec, beside memcpy")
    i.add_argument("--codecs", default="fp32,int8,int4,topk2bit")
    i.add_argument("--params", type=_params, default=50_000_000, help="parameters of θ (default 50M)")
    s = sub.add_parser("sites", parents=[common], help="round time and coordinator CPU against the number of sites")
    s.add_argument("--codec", default="int8")
    s.add_argument("--params", type=_params, default=100_000_000, help="parameters of θ (default 100M)")
    s.add_argument("--sites-list", default="1,2,4,8,16,32")
    s.add_argument(
        "--shards", type=int, default=1, help="coordinator.shards: θ cut into this many ranges, a thread each, in the one coordinator process (default 1)"
    )
    a = p.parse_args(argv)
    if getattr(a, "shards", 1) < 1:
        p.error(f"--shards {a.shards}: must be >= 1")
    if a.rounds < 1 or a.warmup < 0 or a.deltas < 1:
        p.error("--rounds must be >= 1, --warmup >= 0, --deltas >= 1")
    a.coordinator_pythonpath = a.coordinator_pythonpath.resolve()
    if not (a.coordinator_pythonpath / "diloco" / "cli" / "coordinator.py").is_file():
        p.error(f"--coordinator-pythonpath {a.coordinator_pythonpath}: no diloco/cli/coordinator.py there")
    if a.mode == "intake":
        a.plan = []
        return a
    a.plan = [(c, a.sites) for c in a.codecs.split(",") if c] if a.mode == "rates" else [(a.codec, int(x)) for x in a.sites_list.split(",") if x]
    if any(n < 1 for _, n in a.plan):
        p.error("every number of sites must be >= 1")
    return a


def main() -> None:
    roles = {"_coordinator": role_coordinator, "_site": role_site, "_grpc_server": role_grpc_server, "_grpc_client": role_grpc_client, "_intake": role_intake}
    if len(sys.argv) > 1 and sys.argv[1] in roles:
        _die_with_parent()
        roles[sys.argv[1]](sys.argv[2:])
        return
    a = parse(sys.argv[1:])
    signal.signal(signal.SIGTERM, _interrupted)
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "bench": "coordinator",
        "mode": a.mode,
        "command": " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
    }
    result["machine"] = machine(a)
    if a.mode == "intake":
        result["ceilings"] = {"memcpy": memcpy_ceiling(a.memcpy_params, a.rounds)}
        result["intake"] = intake_rates(a)
        print(f"memcpy: {result['ceilings']['memcpy']['params_per_s'] / 1e6:.0f} M float32/s")
        save_result(a.out, result)
        return
    shapes = theta_shapes(a.params)
    result["theta"] = {"params": a.params, "tensors": len(shapes), "matrices": sum(len(s) == 2 for s in shapes.values()), "width": WIDTH}
    with tempfile.TemporaryDirectory(prefix="bench_coordinator_") as tmp:
        work = Path(tmp) if a.work is None else a.work / time.strftime("%Y%m%d_%H%M%S")
        work.mkdir(parents=True, exist_ok=True)
        if not a.no_ceilings:
            result["ceilings"] = {"memcpy": memcpy_ceiling(a.memcpy_params, a.rounds), "grpc": grpc_ceiling(a, work)}
        t0 = time.monotonic()
        write_theta(work / "theta.safetensors", shapes)
        print(f"θ: {a.params / 1e6:.1f}M parameters in {len(shapes)} tensors, written in {time.monotonic() - t0:.1f} s", flush=True)
        deltas: dict[str, list[Path]] = {}
        result["configs"] = []
        for codec, n in a.plan:
            if codec not in deltas:
                t0 = time.monotonic()
                deltas[codec] = encode_deltas(work, shapes, codec, min(a.deltas, max(m for c, m in a.plan if c == codec)))
                print(f"{codec}: {len(deltas[codec])} Δ encoded in {time.monotonic() - t0:.1f} s", flush=True)
            t0 = time.monotonic()
            config = run_config(a, codec, n, work / "theta.safetensors", deltas[codec], a.params, work)
            config["wall_s"] = time.monotonic() - t0
            result["configs"].append(config)
            s = config["summary"]
            print(
                f"{codec} x{n}: {config['wall_s']:.1f} s, round {s['round_s']['median']:.3f} s, coordinator CPU {s['cpu_s']['median'] if s['cpu_s'] else float('nan'):.3f} s/round",
                flush=True,
            )
    print()
    print_table(result)
    save_result(a.out, result)


if __name__ == "__main__":
    main()
