"""The processes of a simulated run: starting one (forked from the zygote, or a fresh
interpreter; torchrun's groups and the WAN emulator always fresh), waiting for the
coordinator's port, and stopping them all, whatever they started included."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from diloco.io import write_json_atomic
from diloco.run_dir import RunDir
from diloco.sim.faults import read_fired
from diloco.sim.links import LinkSpec, WanPlan
from diloco.sim.zygote import Forked, Zygote, die_with_parent


class SimError(RuntimeError):
    """A simulated process failed or the run timed out; the message names the process."""


class SimStopped(SimError):
    """The simulator itself got SIGTERM (its children were stopped): callers running several
    simulations should stop too, not go on to the next one."""


@dataclass
class Proc:
    """One process of the run as the supervisor sees it (a restart replaces it with its next incarnation)."""

    name: str
    popen: subprocess.Popen[bytes] | Forked
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    cmd: list[str] = field(default_factory=list)  # without --incarnation / --skip-faults
    incarnation: int = 0
    restart_at: float | None = None  # a planned kill: start it again then (monotonic)
    gone: bool = False  # killed for good (restart_after_s < 0)
    service: bool = False  # runs until stopped (the WAN emulator): not waited for, stopped last with SIGTERM
    nice: int = 0  # added niceness (sites behind the WAN emulator, so its deliveries are on time)
    zygote: Zygote | None = field(default=None, repr=False)  # what it was forked from (and is again when restarted)


SITE_NICE = 10


def start_wan(wan: WanPlan, run_dir: Path, upstream: Path, procs: list[Proc], deadline: float) -> dict[str, Path]:
    """Starts the WAN emulator between the sites and the coordinator; returns, per site, the
    port file it reads its coordinator address from (the emulator's port for its link)."""
    wan_dir = RunDir(run_dir).wan_dir
    shutil.rmtree(wan_dir, ignore_errors=True)
    wan_dir.mkdir(parents=True)
    spec = {
        "upstream_port_file": str(upstream),
        "links": {s: link.to_dict() for s, link in wan.sites.items()},
        "coordinator": wan.coordinator.to_dict() if wan.coordinator else None,
    }
    write_json_atomic(wan_dir / "spec.json", spec)
    cmd = [
        sys.executable,
        "-m",
        "diloco.sim.wan",
        "--spec",
        str(wan_dir / "spec.json"),
        "--ports-out",
        str(wan_dir / "ports.json"),
        "--stats-out",
        str(wan_dir / "stats.json"),
    ]
    proc = start_process("wan", cmd, run_dir, extra=False)
    proc.service = True
    procs.append(proc)
    ports_file = wan_dir / "ports.json"
    while not ports_file.exists():
        if proc.popen.poll() is not None:
            raise SimError(failure(proc))
        if time.monotonic() > deadline:
            raise SimError(f"the WAN emulator did not start listening in time; see {proc.log_path}")
        time.sleep(0.05)
    ports = json.loads(ports_file.read_text())
    files = {}
    for site, port in ports.items():
        files[site] = wan_dir / f"site-{site}.port.json"
        write_json_atomic(files[site], {"host": "127.0.0.1", "port": int(port)})
    return files


def describe_wan(wan: WanPlan) -> str:
    def one(spec: LinkSpec) -> str:
        rate = (
            "unlimited" if spec.up_mbit is None and spec.down_mbit is None else f"{spec.up_mbit or 'unlimited'}/{spec.down_mbit or 'unlimited'} Mbit/s up/down"
        )
        return (
            f"{rate}, RTT {spec.rtt_ms:g} ms"
            + (f" ± {spec.jitter_ms:g} ms" if spec.jitter_ms else "")
            + (f", window {spec.window_kb:g} KiB per connection" if spec.window_kb else "")
        )

    distinct = {one(spec) for spec in wan.sites.values()}
    sites = f"each site {distinct.pop()}" if len(distinct) == 1 else "; ".join(f"site {s}: {one(spec)}" for s, spec in wan.sites.items())
    return sites + (f"; the coordinator's link {one(wan.coordinator)}" if wan.coordinator else "")


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


CHILD = [sys.executable, "-m", "diloco.sim.child"]  # a process the zygote can fork


def start_process(
    name: str, cmd: list[str], run_dir: Path, incarnation: int = 0, skip_faults: list[int] | None = None, extra: bool = True, nice: int = 0,
    zygote: Zygote | None = None,
) -> Proc:  # fmt: skip
    suffix = f".{incarnation}" if incarnation else ""
    log_path = RunDir(run_dir).log(name.replace(" ", ""), suffix)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "wb")
    env = child_env()
    args = ["--incarnation", str(incarnation), "--skip-faults", ",".join(map(str, skip_faults or []))] if extra else []
    popen: subprocess.Popen[bytes] | Forked
    if zygote is not None and cmd[: len(CHILD)] == CHILD:
        try:
            popen = zygote.spawn(cmd[len(CHILD) :] + args, log_path, env, nice)  # its own session, as below
        except RuntimeError as e:  # the zygote died (its traceback is on this process's stderr)
            log_file.close()
            raise SimError(f"{name}: {e}") from None
    else:
        # Its own process group, so that stopping it also stops what it started (torchrun's ranks).
        popen = subprocess.Popen(
            cmd + args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=child_setup(nice), start_new_session=True
        )
    pids = RunDir(run_dir).pids
    write_json_atomic(pids, {**(json.loads(pids.read_text()) if pids.exists() else {}), name: popen.pid})
    return Proc(name, popen, log_path, log_file, cmd=list(cmd), incarnation=incarnation, nice=nice, zygote=zygote)


def child_setup(nice: int) -> Callable[[], None]:
    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    return setup


def next_incarnation(run_dir: Path, name: str) -> int:
    """0 for a fresh run; after a resume, one more than the process's last log."""
    base = name.replace(" ", "")
    logs = [p.stem for p in RunDir(run_dir).logs_dir.glob("*.log") if p.stem == base or p.stem.startswith(base + ".")]
    if not logs:
        return 0
    return 1 + max(int(stem.split(".")[1]) if "." in stem else 0 for stem in logs)


def fired_events(run_dir: Path) -> list[int]:
    return sorted({e["event"] for e in read_fired(run_dir)})


def wait_port(port_file: Path, coordinator: Proc, deadline: float) -> int:
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(json.loads(port_file.read_text())["port"])
        if coordinator.popen.poll() is not None:
            raise SimError(failure(coordinator))
        time.sleep(0.05)
    raise SimError(f"the coordinator did not start listening in time; see {coordinator.log_path}")


def failure(p: Proc) -> str:
    tail = p.log_path.read_text(errors="replace").strip().splitlines()[-5:] if p.log_path.exists() else []
    lines = "\n    ".join(tail)
    return f"{p.name} (pid {p.popen.pid}) exited with code {p.popen.returncode}; log: {p.log_path}\n    {lines}"


def is_torchrun(cmd: list[str]) -> bool:
    return "torch.distributed.run" in cmd


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.service and p.popen.poll() is None:
            p.popen.terminate()  # the WAN emulator writes its stats on SIGTERM
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)  # the process and whatever it started
        except (ProcessLookupError, PermissionError):
            if p.popen.poll() is None:  # forked an instant ago: not yet the leader of its session
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        p.log_file.close()
