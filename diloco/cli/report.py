"""diloco-report: several runs on the same axes, and a table of their final figures.

    diloco-report runs/demo runs/ddp                    # plots into ./report, the table on stdout
    diloco-report runs/int8 runs/topk2bit --out cmp --label int8 --label topk2bit
    diloco-report runs/demo runs/ddp --figure docs/figures/demo_vs_ddp.png

Each RUN_DIR is a run directory (diloco-sim's, or a coordinator's: the one holding
metrics.jsonl). Writes into --out: eval_vs_tokens.png, train_loss_vs_tokens.png,
eval_vs_bytes.png (log scale), overview.png (the three side by side) and table.md; --figure
also writes overview.png to the path given. ``--json`` prints the table as JSON.
A path that is not a run directory, or a run without metrics.jsonl, exits with status 2
naming it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from diloco.observe.rundata import RunData, RunDirError, load_run

COLUMNS = ("run", "mode", "sites", "H", "codec", "rounds", "tokens", "bytes", "final_eval", "wall_s")


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "bytes":
        return _bytes(int(value))
    if key == "tokens":
        return f"{int(value):,}"
    if key == "final_eval":
        return f"{value:.4f}"
    if key == "wall_s":
        return f"{value:.1f}"
    return str(value)


def rows(runs: Sequence[RunData], labels: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for run, label in zip(runs, labels):
        f = run.finals()
        metric = run.eval_metric
        out.append(
            {
                **{k: f.get(k) for k in COLUMNS if k != "final_eval"},
                "run": label,
                "final_eval": f[f"final_{metric}"],
                "eval_metric": metric,
                "path": str(run.path),
            }
        )
    return out


def table(rs: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, readable as plain text."""
    metrics = {r["eval_metric"] for r in rs}
    head = [c if c != "final_eval" else "final " + ("/".join(sorted(metrics))) for c in COLUMNS]
    body = [[_cell(c, r[c]) for c in COLUMNS] for r in rs]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    numeric = {"sites", "H", "rounds", "tokens", "bytes", "final_eval", "wall_s"}

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if COLUMNS[i] in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if COLUMNS[i] in numeric else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule, *(line(b) for b in body)])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="diloco-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="report", type=Path, help="where the plots and table.md go (default: ./report)")
    p.add_argument("--label", action="append", help="the legend's name for each run, in order (once per run)")
    p.add_argument("--figure", type=Path, help="also write overview.png (the three plots side by side) to this path")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append(load_run(path))
        except RunDirError as e:
            fail(str(e))
    if args.label is not None and len(args.label) != len(runs):
        fail(f"--label given {len(args.label)} time(s) for {len(runs)} run(s): give one per run, in order")
    if args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out}: exists and is not a directory")

    from diloco.observe.plots import plot_runs, run_labels  # matplotlib: only once the input is good

    labels = run_labels(runs, args.label)
    written = plot_runs(runs, args.out, labels)
    rs = rows(runs, labels)
    text = table(rs)
    (args.out / "table.md").write_text(text + "\n")
    if args.figure is not None:
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.out / "overview.png", args.figure)
        written.append(args.figure)
    if args.json:
        print(json.dumps(rs, indent=1), flush=True)
    else:
        print(text)
        print(f"plots: {', '.join(str(w) for w in written)}", flush=True)


if __name__ == "__main__":
    main()
