"""Whether two sets of runs computed the same θ, round by round: for every run directory (one
holding metrics.jsonl) under BEFORE, the one at the same relative path under AFTER, compared by
each committed round's global_sha256 and the final eval bpb. Exit status 1 if any differ.

    .venv/bin/python scripts/compare_runs.py runs/before runs/after
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rounds(run: Path) -> dict[int, str]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {int(m["round"]): str(m["global_sha256"]) for m in lines}


def final_bpb(run: Path) -> float | None:
    summary = run / "summary.json"
    return json.loads(summary.read_text()).get("final_eval_bpb") if summary.exists() else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    args = p.parse_args()
    runs = sorted(m.parent.relative_to(args.before) for m in args.before.rglob("metrics.jsonl"))
    if not runs:
        print(f"no run directory (metrics.jsonl) under {args.before}")
        return 1
    bad = 0
    for rel in runs:
        a, b = args.before / rel, args.after / rel
        if not (b / "metrics.jsonl").exists():
            print(f"{rel}: missing under {args.after}")
            bad += 1
            continue
        ra, rb = rounds(a), rounds(b)
        same = ra == rb
        bad += not same
        last = max(ra) if ra else None
        print(
            f"{rel}: {len(ra)} rounds, per-round hashes {'equal' if same else 'DIFFER'}"
            f" (last {ra.get(last, '-')[:16]} / {rb.get(last, '-')[:16]}); final bpb {final_bpb(a)} / {final_bpb(b)}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
