"""Peak memory of the coordinator and of each site, measured by /usr/bin/time -v.

Starts ``diloco-coordinator`` and ``sites`` × ``diloco-site`` as separate processes on
127.0.0.1, each under ``/usr/bin/time -v``, waits for the run to finish, and prints every
process's "Maximum resident set size" (the kernel's peak RSS) with its wall time.

    .venv/bin/python scripts/bench_memory.py --sites 4 -- model=tiny sync.every=50 rounds=3

Everything after ``--`` is passed as hydra overrides to every process.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _peak_kib(time_output: str) -> int:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_output)
    if not m:
        raise RuntimeError(f"no 'Maximum resident set size' in /usr/bin/time output:\n{time_output[-2000:]}")
    return int(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if not Path("/usr/bin/time").exists():
        print("error: /usr/bin/time is not installed (Debian package 'time')", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    common = [f"sites={args.sites}", *args.overrides]
    port_file = work / "port.json"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def start(name: str, cmd: list[str]) -> None:
        logs[name] = work / f"{name}.time"
        procs[name] = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(logs[name]), *cmd], stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT)

    t0 = time.monotonic()
    try:
        start(
            "coordinator",
            [str(BIN / "diloco-coordinator"), *common, "coordinator.port=0", f"coordinator.port_file={port_file}", f"hydra.run.dir={work / 'coordinator'}"],
        )
        while not port_file.exists():
            if procs["coordinator"].poll() is not None:
                raise RuntimeError((work / "coordinator.log").read_text())
            time.sleep(0.1)
        port = json.loads(port_file.read_text())["port"]
        for s in range(args.sites):
            start(f"site{s}", [str(BIN / "diloco-site"), *common, f"site.id={s}", f"site.coordinator=127.0.0.1:{port}", f"hydra.run.dir={work / f'site{s}'}"])
        for name, proc in procs.items():
            rc = proc.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
            if rc != 0:
                raise RuntimeError(f"{name} exited with {rc}; log: {work / (name + '.log')}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    wall = time.monotonic() - t0
    params = json.loads((work / "coordinator" / "global.json").read_text())["params"]
    print(f"bench_memory: sites={args.sites} overrides={args.overrides} params={params} wall_s={wall:.1f}")
    for name in procs:
        print(f"  {name:<12} peak RSS {_peak_kib(logs[name].read_text()) / 1024:8.1f} MiB")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
