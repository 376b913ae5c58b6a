"""The status page's figure (docs/figures/status_page.png), taken from a real run: starts
``diloco-sim`` (4 sites, H=20, 12 rounds, plaintext on loopback so that the headless browser needs
no credentials), waits until ``--after`` rounds are in metrics.jsonl, screenshots the page with
Debian's headless Chromium (scripts/setup_browser.sh installs it), and stops the run.

    .venv/bin/python scripts/screenshot_status_page.py --out docs/figures/status_page.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIM = str(Path(sys.executable).with_name("diloco-sim"))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no chromium here: run scripts/setup_browser.sh")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/figures/status_page.png"))
    p.add_argument("--after", type=int, default=10, help="screenshot once this many rounds' lines are in metrics.jsonl")
    p.add_argument("--size", default="1400,860", help="the browser window, width,height")
    args = p.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="status_shot_")) / "run"
    cmd = [SIM, f"hydra.run.dir={run_dir}", "sites=4", "sync.every=20", "rounds=12", "eval_every=2", "sim.credentials=false", "sim.plots=false"]
    sim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= args.after):
            if sim.poll() is not None:
                raise SystemExit(f"diloco-sim exited ({sim.returncode}) before {args.after} rounds; see {run_dir}/logs")
            time.sleep(0.5)
        url = json.loads((run_dir / "status_page.json").read_text())["url"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
                 f"--window-size={args.size}", "--virtual-time-budget=5000", f"--screenshot={args.out.resolve()}", url],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
        print(f"{args.out}: the status page of {url} after {args.after} rounds")
    finally:
        try:
            os.killpg(sim.pid, signal.SIGTERM)
            sim.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(sim.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
