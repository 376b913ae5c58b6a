"""What watching a run costs: the default demo (``diloco-sim`` with no overrides, as
``scripts/demo.sh`` runs it) with TensorBoard, Prometheus /metrics and the status page on (the
defaults) against the same run with all three off, in alternating pairs in one sitting, so that
the ratio is not a drift of the machine. From one of the "on" runs it keeps a scrape of the
coordinator's /metrics taken mid-run (parsed by prometheus_client's parser to check it).

    .venv/bin/python scripts/bench_observe.py --pairs 3 --out docs/measurements/observe_cost.json

Both sides keep the plots drawn at the end (sim.plots) and the progress lines; "off" is
``tensorboard.enabled=false metrics.port=null status.port=null``. Reported per side: the median
of the run's own wall time (summary.json's wall_s: start to last round) and of the process's
(start to exit, plots included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

OFF = ["tensorboard.enabled=false", "metrics.port=null", "status.port=null"]
SIM = str(Path(sys.executable).with_name("diloco-sim"))


def _scrape_mid_run(run_dir: Path, after_rounds: int, into: dict[str, Any], stop: threading.Event) -> None:
    """Waits for ``after_rounds`` lines of metrics.jsonl, then scrapes the coordinator's /metrics once."""
    address = run_dir / "prometheus" / "coordinator.json"
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        if address.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= after_rounds:
            url = json.loads(address.read_text())["url"]
            with urllib.request.urlopen(url, timeout=10) as reply:
                into["text"] = reply.read().decode()
            into["url"], into["after_rounds"] = url, after_rounds
            return
        stop.wait(0.5)


def run_once(root: Path, name: str, extra: list[str], scrape: dict[str, Any] | None) -> dict[str, Any]:
    run_dir = root / name
    stop = threading.Event()
    scraper = None
    if scrape is not None:
        scraper = threading.Thread(target=_scrape_mid_run, args=(run_dir, 5, scrape, stop), daemon=True)
        scraper.start()
    start = time.perf_counter()
    proc = subprocess.run([SIM, f"hydra.run.dir={run_dir}", *extra], capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    stop.set()
    if scraper is not None:
        scraper.join(15)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: diloco-sim exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "run": name,
        "process_s": round(wall, 2),
        "wall_s": summary["wall_s"],
        "eval_bpb": summary.get("final_eval_bpb"),
        "hashes_equal": summary.get("hashes_equal"),
    }


def excerpt(text: str, keep: tuple[str, ...]) -> str:
    """The HELP/TYPE lines and samples of the families whose names start with ``keep``."""
    from prometheus_client.parser import text_string_to_metric_families

    names = [f.name for f in text_string_to_metric_families(text)]  # parses the whole scrape: it is valid
    assert names, "an empty scrape"
    lines = [line for line in text.splitlines() if any(k in line for k in keep) and "_created" not in line and "_bucket{" not in line]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="on/off pairs, alternating (on first in even pairs)")
    p.add_argument("--out", type=Path, default=None, help="write the results (and the /metrics excerpt) as JSON here")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories under this folder (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="extra diloco-sim overrides for both sides (default: none, the demo)")
    args = p.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_observe_"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    scrape: dict[str, Any] = {}
    for i in range(args.pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for side in order:
            extra = list(args.overrides) + (OFF if side == "off" else [])
            r = run_once(root, f"{side}{i}", extra, scrape if side == "on" and not scrape else None)
            runs[side].append(r)
            print(json.dumps({"side": side, **r}), flush=True)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "process_s")} for side, rs in runs.items()}
    ratio = {k: round(med["on"][k] / med["off"][k], 4) for k in ("wall_s", "process_s")}
    print(f"{'':6s}{'run wall_s (median)':>22s}{'process s (median)':>22s}")
    for side in ("on", "off"):
        print(f"{side:6s}{med[side]['wall_s']:22.2f}{med[side]['process_s']:22.2f}")
    print(f"{'on/off':6s}{ratio['wall_s']:22.4f}{ratio['process_s']:22.4f}")
    text = scrape.get("text", "")
    part = (
        excerpt(
            text,
            tuple(
                f"diloco_coordinator_{n}"
                for n in ("rounds_committed", "open_round", "sites", "pushes_", "received_bytes", "sent_bytes", "commit_duration_seconds")
            ),
        )
        if text
        else ""
    )
    if part:
        print(f"\n/metrics of the coordinator after {scrape['after_rounds']} rounds ({scrape['url']}), an excerpt:\n{part}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                    "overrides_off": OFF,
                    "runs": runs,
                    "median": med,
                    "ratio_on_off": ratio,
                    "metrics_excerpt": part,
                    "metrics_full": text,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
