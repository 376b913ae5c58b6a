"""What tests of several tiers share: a fake clock, the repository root, running diloco-sim as
a user would (its console script, in its own process group), and a coordinator made, joined,
pushed to and served on 127.0.0.1 the way most coordinator tests need one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.outer import OuterConfig
    from diloco.transport import CoordinatorClient
    from diloco.types import JoinInfo, PushResult

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A monotonic clock that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sim_command() -> list[str]:
    """diloco-sim as installed (next to this Python, in .venv, or on PATH), else its module
    (a machine where the project is importable but its console scripts are not installed)."""
    for candidate in (Path(sys.executable).parent / "diloco-sim", ROOT / ".venv" / "bin" / "diloco-sim"):
        if candidate.exists():
            return [str(candidate)]
    found = shutil.which("diloco-sim")
    return [found] if found else [sys.executable, "-m", "diloco.cli.sim"]


# ---- running the CLI -----------------------------------------------------------------


@dataclass
class Run:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str

    def json(self, name: str) -> Any:
        return json.loads((self.run_dir / name).read_text())

    @property
    def summary(self) -> dict[str, Any]:
        return self.json("summary.json")

    @property
    def metrics(self) -> list[dict[str, Any]]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def workers(self) -> dict[str, dict[str, Any]]:
        return {p.stem: json.loads(p.read_text()) for p in sorted((self.run_dir / "workers").glob("*.json"))}

    def describe(self) -> str:
        logs = ""
        log_dir = self.run_dir / "logs"
        if log_dir.is_dir():
            for p in sorted(log_dir.glob("*.log")):
                logs += f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
        return f"rc={self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}{logs}"


def kill_group(popen: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- a standalone coordinator and site processes (torchrun groups or one process) ----------


def popen_logged(args: list[str], log: Path, cwd: Path = ROOT / "tests") -> subprocess.Popen[Any]:
    """``args`` in its own process group, stdout and stderr to ``log``; this checkout's ``diloco``
    first on the path (a worktree's, not the venv's editable install)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd, env=env)


def torchrun(ranks: int, script: str, *args: str, restarts: int = 1, one_plain: bool = True) -> list[str]:
    """``script ARGS`` as a torchrun group of ``ranks`` (for 1, a plain process unless not ``one_plain``)."""
    if ranks == 1 and one_plain:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={restarts}", script, *args]


def logs_of(d: Path) -> str:
    """The tail of every ``*.log`` in ``d``, for an assertion's message."""
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(d.glob("*.log")))


def stop_all(procs: list[subprocess.Popen[Any]]) -> None:
    """Kills what is left of each process's group and reaps it."""
    for p in procs:
        if p.poll() is None:
            kill_group(p)
        p.wait(10)


def start_coordinator(d: Path, *overrides: str) -> tuple[subprocess.Popen[Any], Path]:
    """``diloco-coordinator OVERRIDES`` on 127.0.0.1, port 0, its run in ``d/coord``, its log
    ``d/coord.log``; returns the process and its port file (see ``address_of``)."""
    port_file = d / "port.json"
    args = [str(Path(sys.executable).parent / "diloco-coordinator"), *overrides, "coordinator.host=127.0.0.1", "coordinator.port=0"]
    return popen_logged([*args, f"coordinator.port_file={port_file}", f"hydra.run.dir={d / 'coord'}"], d / "coord.log"), port_file


def address_of(coordinator: subprocess.Popen[Any], port_file: Path, timeout: float = 60.0) -> str:
    """HOST:PORT of a coordinator once its port file exists (it failed or took too long: the logs)."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        assert coordinator.poll() is None and time.monotonic() < deadline, logs_of(port_file.parent)
        time.sleep(0.1)
    return f"127.0.0.1:{json.loads(port_file.read_text())['port']}"


def wait_for_log(d: Path, log: str, says: str, proc: subprocess.Popen[Any], timeout: float = 90.0) -> None:
    """Waits until ``d/log`` contains ``says`` (``proc`` ended first, or too long: the logs)."""
    deadline = time.monotonic() + timeout
    while says not in (d / log).read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, logs_of(d)
        time.sleep(0.1)


def coordinator_records(d: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """global.json and metrics.jsonl's records of the coordinator run in ``d/coord``."""
    final = json.loads((d / "coord" / "global.json").read_text())
    return final, [json.loads(line) for line in (d / "coord" / "metrics.jsonl").read_text().splitlines()]


def run_sim(run_dir: Path, *overrides: str, timeout: float = 120.0, plots: bool = False) -> Run:
    """Runs ``diloco-sim OVERRIDES hydra.run.dir=RUN_DIR`` to the end (or kills it on timeout).
    Without the plots unless ``plots`` or an override says otherwise: drawing them takes a run
    about a second, and only tests/integration/test_report_cli.py looks at them."""
    run_dir = run_dir.resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if not plots and not any(o.startswith("sim.plots=") for o in overrides):
        overrides = (*overrides, "sim.plots=false")
    cmd = [*sim_command(), *overrides, f"hydra.run.dir={run_dir}"]
    popen = subprocess.Popen(
        cmd, cwd=run_dir.parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(popen)
        stdout, stderr = popen.communicate()
        pytest.fail(f"diloco-sim {' '.join(overrides)} did not finish within {timeout}s\n{stdout[-2000:]}\n{stderr[-2000:]}")
    finally:
        kill_group(popen)  # nothing of the run may outlive it
    return Run(run_dir, popen.returncode, stdout, stderr)


def run_ok(run_dir: Path, *overrides: str, timeout: float = 120.0, plots: bool = False) -> Run:
    run = run_sim(run_dir, *overrides, timeout=timeout, plots=plots)
    assert run.returncode == 0, run.describe()
    return run


def processes_of(run_dir: Path) -> dict[int, list[str]]:
    """pid -> argv of every live process whose command line names ``run_dir``."""
    needle = str(run_dir)
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv = raw.decode(errors="replace").split("\0")
        if any(needle in arg for arg in argv):
            found[int(entry.name)] = argv
    return found


def expect_refused(fn: Callable[[], object], *kinds: str, says: tuple[str, ...] = ()) -> Any:
    """Calls ``fn``, which must raise a RemoteError of one of ``kinds`` whose message holds
    every fragment in ``says``; returns the error."""
    from diloco.errors import RemoteError

    with pytest.raises(RemoteError) as info:
        fn()
    assert info.value.kind in kinds, info.value
    for fragment in says:
        assert fragment in info.value.message, info.value.message
    return info.value


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak memory traced (Python and numpy allocations, zstd's output buffer) while ``fn`` runs."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ---- θ, pseudo-gradients and a coordinator to push them to ---------------------------------


def generator(seed: int = 0) -> torch.Generator:
    """A torch generator seeded with ``seed``: the same draws on every run."""
    import torch

    return torch.Generator().manual_seed(seed)


def theta(shapes: Mapping[str, tuple[int, ...]], seed: int | None = None) -> dict[str, torch.Tensor]:
    """float32 tensors of ``shapes``, the same on every call: with ``seed``, standard normal
    values drawn in the order of ``shapes`` from one generator seeded with it; without, each
    tensor counts 0, 1, 2, ... through its elements (values a test can name)."""
    import math

    import torch

    if seed is None:
        return {n: torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for n, s in shapes.items()}
    g = generator(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def small_theta() -> dict[str, Any]:
    """θ of two small tensors (a 4x3 weight and a bias of 3), the same on every call."""
    return theta({"layer.w": (4, 3), "layer.b": (3,)}, seed=1)


def filled(like: Mapping[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    """A pseudo-gradient shaped like ``like``, every element ``value``."""
    import torch

    return {n: torch.full_like(t, value) for n, t in like.items()}


def random_delta(like: Mapping[str, torch.Tensor], seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    """A pseudo-gradient shaped like ``like``: standard normal values from a generator seeded
    with ``seed``, drawn in the order of ``like``, times ``scale``."""
    import torch

    g = generator(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in like.items()}


def join(target: Coordinator | CoordinatorClient, params: Mapping[str, torch.Tensor], *sites: str) -> list[JoinInfo]:
    """Joins each of ``sites`` (in order) to a coordinator, in process or through a client,
    with the fingerprint of ``params``; returns what each join answered."""
    from diloco.types import JoinRequest
    from diloco.wire.fingerprint import fingerprint

    specs = tuple(fingerprint(params).values())
    return [target.join(JoinRequest(s, specs)) for s in sites]


def push(
    target: Coordinator | CoordinatorClient, site: str, round: int, delta: Mapping[str, torch.Tensor], *, tokens: int = 10, codec: str = "fp32", **header: Any
) -> PushResult:
    """``site``'s push of ``delta`` for ``round``, to a coordinator in process or through a
    client: train loss 1.0, one inner step (``header`` sets those or any other PushHeader
    field), the chunks encoded with ``codec`` as the push streams."""
    from diloco.codec import get_codec
    from diloco.types import PushHeader
    from diloco.wire import encode_chunks

    fields = {"train_loss": 1.0, "inner_steps": 1, **header}
    return target.push(PushHeader(site_id=site, round=round, tokens=tokens, **fields), encode_chunks(delta, codec=get_codec(codec)))


def coordinator(
    params: Mapping[str, torch.Tensor] | None,
    cfg: CoordinatorConfig,
    *,
    outer: OuterConfig | None = None,
    sites: tuple[str, ...] = (),
    clock: Callable[[], float] | None = None,
) -> Coordinator:
    """A coordinator holding ``params`` as θ_0 (None: none yet, init=site; outer: OuterConfig()
    unless given; clock: the real monotonic one unless given), with ``sites`` joined."""
    from diloco.coordinator import Coordinator
    from diloco.outer import OuterConfig

    coord = Coordinator(params, outer if outer is not None else OuterConfig(), cfg, **({"clock": clock} if clock is not None else {}))
    if sites:
        assert params is not None, "sites join with θ_0's fingerprint"
        join(coord, params, *sites)
    return coord


@contextmanager
def served_coordinator(coord: Coordinator, **serve_options: Any) -> Iterator[str]:
    """``coord`` behind a real gRPC server on 127.0.0.1:<a free port> (``serve_options``:
    diloco.transport.serve's security, limits, observer...); yields its address and stops the
    server when the block ends."""
    from diloco.transport import serve

    server, port = serve(coord, "127.0.0.1", 0, **serve_options)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)


@contextmanager
def served_client(coord: Coordinator, **serve_options: Any) -> Iterator[CoordinatorClient]:
    """A client (10 s timeouts) of ``coord`` served as served_coordinator serves it; the client
    is closed before the server stops."""
    from diloco.transport import CoordinatorClient

    with served_coordinator(coord, **serve_options) as address, CoordinatorClient(address, timeout_s=10, connect_timeout_s=10) as client:
        yield client
