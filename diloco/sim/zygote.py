"""A warm process that a simulation forks its Python processes from.

A fresh interpreter for each coordinator, site or baseline rank spends ~3.5 s of CPU before it
does any work: torch's import, then torch._dynamo's (which ``torch.optim`` imports on its
first step), then this package's. A simulation starts several of them on one machine at once
(and starts killed ones again), so those seconds were most of a short run. The zygote is
started once per simulation, imports all of that once, and forks each child from there: a
child starts in milliseconds with the same modules, its own session, log file, environment
and niceness, and runs ``diloco.sim.child.main`` as a fresh process would.

The zygote is single-threaded and touches no tensor, so forking it is safe (no thread pool
or lock is copied mid-use); CUDA is initialized only in the children. Protocol: the launcher
writes one JSON request per line to its stdin (``argv``, ``log``, ``env``, ``nice``); the
zygote answers ``{"pid": ...}`` for each, in order, and ``{"exit": pid, "code": ...}`` when a
child ends (the code as subprocess reports it: negative for a signal). It dies with the
simulator (PR_SET_PDEATHSIG), its children with it; the simulator kills it once the run's
processes are stopped (on EOF it exits too). torchrun groups and
the WAN emulator are not forked from it: they start as processes of their own.

Run as ``python -m diloco.sim.zygote --run-dir DIR``: the run's directory is in every
child's command line (they share the zygote's), so ``ps`` shows which run a process is of.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import random
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

START_TIMEOUT_S = 120.0  # the zygote's imports; a loaded machine takes a few seconds


def die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent dies (no-op elsewhere): a killed
    simulator never leaves a coordinator or sites behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---- the launcher's side -----------------------------------------------------------------
class Zygote:
    """The launcher's handle on the zygote process: ``spawn`` forks a child from it."""

    def __init__(self, run_dir: Path, env: Mapping[str, str]) -> None:
        cmd = [sys.executable, "-m", "diloco.sim.zygote", "--run-dir", str(run_dir)]
        self._popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env), preexec_fn=die_with_parent, start_new_session=True)
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._pids: queue.Queue[int | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._alive = True
        self._reader = threading.Thread(target=self._read, args=(self._popen.stdout,), name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self, out: IO[bytes]) -> None:
        for line in out:
            msg = json.loads(line)
            if "pid" in msg:
                self._pids.put(int(msg["pid"]))
            elif "exit" in msg:
                with self._cv:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                    self._cv.notify_all()
        with self._cv:  # the zygote is gone: so are its children (they die with it)
            self._alive = False
            self._cv.notify_all()
        self._pids.put(None)

    def spawn(self, argv: list[str], log: Path, env: Mapping[str, str], nice: int = 0) -> Forked:
        """Forks ``python -m diloco.sim.child ARGV`` from the zygote, its output into ``log``."""
        request = json.dumps({"argv": list(argv), "log": str(log), "env": dict(env), "nice": nice}) + "\n"
        with self._lock:
            assert self._popen.stdin is not None
            try:
                self._popen.stdin.write(request.encode())
                self._popen.stdin.flush()
                pid = self._pids.get(timeout=START_TIMEOUT_S)
            except (BrokenPipeError, queue.Empty):
                pid = None
        if pid is None:
            raise RuntimeError(f"the simulation's zygote process (pid {self._popen.pid}) did not start a child; exit code {self._popen.poll()}")
        return Forked(pid, self)

    def code_of(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it has ended (waiting up to ``timeout``; None: not yet)."""
        with self._cv:
            self._cv.wait_for(lambda: pid in self._exits or not self._alive, timeout=timeout)
            if pid in self._exits:
                return self._exits[pid]
            return None if self._alive else -signal.SIGKILL

    def close(self) -> None:
        """Ends the zygote at once (it may still be importing; any child left dies with it)."""
        if self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()
        self._reader.join(timeout=5)


class Forked:
    """A child forked by the zygote, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.code_of(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.code_of(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


# ---- the zygote's side -------------------------------------------------------------------
def _warm() -> None:
    """Everything a child imports before it works (and torch._dynamo, which the first step
    of a torch.optim optimizer imports). No tensor is touched: no thread pool may start."""
    import torch._dynamo  # noqa: F401

    import diloco.app.baseline  # noqa: F401
    import diloco.app.coordinator  # noqa: F401
    import diloco.app.site  # noqa: F401
    import diloco.sim.child  # noqa: F401


def _child(request: dict[str, Any]) -> None:
    """In the forked child: becomes the process a fresh start would have made, runs it, exits."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        # Opened while 0-2 are the zygote's pipes (so above them), then put in their place.
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("nice"):
            os.nice(int(request["nice"]))
        random.seed()  # not the zygote's sequence, shared by every child
        import torch

        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            torch.set_num_threads(int(threads))
        from diloco.sim.child import main

        sys.argv = ["diloco.sim.child", *request["argv"]]
        code = main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the child's log, as a fresh process would
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve() -> None:
    """The zygote's loop: fork on each request, report each child's end; exit on EOF."""
    die_with_parent()
    _warm()
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    children: set[int] = set()
    buf = b""

    def say(msg: dict[str, Any]) -> None:
        os.write(out, (json.dumps(msg) + "\n").encode())

    while True:
        ready, _, _ = select.select([inp], [], [], 0.05)
        if ready:
            chunk = os.read(inp, 1 << 16)
            if not chunk:
                return  # the simulator is done (or gone): the children die with this process
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line))
                children.add(pid)
                say({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m diloco.sim.zygote")
    p.add_argument("--run-dir", required=True, help="the run it serves (shown in every child's command line)")
    p.parse_args()
    serve()
    os._exit(0)  # no interpreter teardown: with torch loaded it takes a second or more


if __name__ == "__main__":
    main()
