"""Every headline figure of README.md and docs/results.md against its committed result file.

Each entry of FIGURES names the doc, the figure, a regular expression that finds the figure in
the doc (its first group is the number as written), the result files, and a function that
computes the figure from them. The doc's number is compared with the computed one rounded to
as many decimals as the doc writes, so a default or a rerun that moves a figure fails here,
naming the doc, the figure and the file, instead of leaving a stale figure behind. A row of
docs/results.md's "Headlines" table without an entry here fails too.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
M = "docs/measurements/"
README = "README.md"
RESULTS = "docs/results.md"
NUMBER = re.compile(r"[+\-−]?\d[\d,]*(?:\.\d+)?")


@cache
def load(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


def overlap_run(path: str, mode: str | None = None) -> dict[str, Any]:
    """One mode's run of a bench_overlap.py result file (its only run when mode is None)."""
    runs = load(path)["runs"]
    if mode is None:
        (only,) = runs.values()
        return only
    return runs[mode]


def bpb(path: str, mode: str | None = None) -> float:
    return float(overlap_run(path, mode)["final_eval_bpb"])


def utilization(path: str, mode: str | None = None) -> float:
    """Compute utilization over the whole run, in percent."""
    return 100 * float(overlap_run(path, mode)["compute_utilization"]["run"])


def pct(value: float, base: float) -> float:
    return 100 * (value / base - 1)


# Blocking DiLoCo over 10 rounds, seeds 0, 1, 2 (loopback; the runs each seed is compared with).
BLOCKING_R10 = [
    (M + "overlap_r10_loopback_s0_blocking_finalavg.json", None),
    (M + "overlap_r10_loopback_s1_tau7.json", "blocking"),
    (M + "overlap_r10_loopback_s2_tau7.json", "blocking"),
]
BLOCKING_R30 = M + "overlap_r30_loopback_blocking_s12.json"
FREEZE_10MBIT = [M + f"overlap_10mbit_r10_tau5_ahead_int4down_balanced_freeze{s}.json" for s in ("", "_2", "_3")]


def seeds(pattern: str) -> list[str]:
    return [M + pattern.format(s=s) for s in range(3)]


def median_vs_blocking(files: list[str]) -> float:
    """The median over seeds 0, 1, 2 of each seed's bpb against blocking's on the same seed."""
    return statistics.median(pct(bpb(f), bpb(*b)) for f, b in zip(files, BLOCKING_R10, strict=True))


def quality_runs(path: str, mode: str) -> list[dict[str, Any]]:
    return [r for r in load(path)["runs"] if r["mode"] == mode]


def bytes_per_round(path: str, mode: str) -> float:
    (run,) = quality_runs(path, mode)
    return run["bytes_up"] / run["rounds"]


def flush_denormal_ratio(path: str) -> float:
    """Kept over flushed: the medians of the windows of the last third of the steps."""
    windows: dict[bool, list[tuple[int, float]]] = {True: [], False: []}
    for line in (ROOT / path).read_text().splitlines():
        m = re.match(r"flush_denormal=(True|False)\s+steps\s+(\d+)-\s*(\d+): ([\d.]+) s/step", line)
        if m:
            windows[m[1] == "True"].append((int(m[3]), float(m[4])))
    last = max(end for end, _ in windows[False])

    def tail(mode: bool) -> float:
        return statistics.median(t for end, t in windows[mode] if end > last * 2 / 3)

    return tail(False) / tail(True)


def striping_speedup(path: str, streams: int) -> float:
    """The whole sync's time with one stream over its time with ``streams``."""
    sync_s = {r["streams"]: r["sync_s"] for r in load(path)["rows"]}
    return sync_s[1] / sync_s[streams]


def gpu(bench: str, key: str) -> float:
    return float(load("docs/gpu_check_h200.json")["summary"][bench][key])


PYDOCS60 = M + "quality_pydocs60_finalavg_s0.json"
R60 = M + "quality_r60_rule_finalavg_s0.json"
SYNC = M + "sync_vs_torchft_simple.json"
H200 = "docs/gpu_check_h200.json"


class Figure(NamedTuple):
    doc: str
    name: str
    pattern: str  # its first group is the number as the doc writes it
    files: tuple[str, ...]
    compute: Callable[[], float]


def row(name: str) -> str:
    """The value cell of the docs/results.md table row whose first cell is ``name``."""
    return r"(?m)^\| " + re.escape(name) + r" \| ([^|]*?) \|"


def results(name: str, files: tuple[str, ...] | list[str], compute: Callable[[], float]) -> Figure:
    return Figure(RESULTS, name, row(name), tuple(files), compute)


def readme(name: str, pattern: str, files: tuple[str, ...] | list[str], compute: Callable[[], float]) -> Figure:
    return Figure(README, name, pattern, tuple(files), compute)


TAU5_AHEAD = seeds("overlap_r10_loopback_s{s}_tau5_ahead_head.json")
FREEZE_SEEDS = seeds("overlap_r10_loopback_s{s}_tau5_ahead_int4down_balanced_freeze.json")
BLOCKING_FILES = tuple(f for f, _ in BLOCKING_R10)

DEMO = M + "demo_summary.json"  # scripts/demo.sh's run: .venv/bin/diloco-sim (every default), summary.json

FIGURES: list[Figure] = [
    # README.md, "Two commands": the demo's output
    readme("the demo's final held-out bpb", r'"final_eval_bpb": ([\d.]+),', [DEMO], lambda: float(load(DEMO)["final_eval_bpb"])),
    readme("the demo's last round line", r"round  10/10  workers 4  train_loss [\d.]+  eval_bpb ([\d.]+)", [DEMO], lambda: float(load(DEMO)["final_eval_bpb"])),
    # README.md, "A real multi-site run", "Slow links"
    readme(
        "blocking utilization at 100 Mbit/s",
        r"where blocking\s+DiLoCo computes ([\d.]+)% of the time",
        [M + "overlap_100mbit_r10_tau7_ahead.json"],
        lambda: utilization(M + "overlap_100mbit_r10_tau7_ahead.json", "blocking"),
    ),
    readme(
        "streaming utilization at 100 Mbit/s",
        r"τ = 5 computes ([\d.]+)% of the whole run",
        [M + "overlap_100mbit_r10_tau5_ahead.json"],
        lambda: utilization(M + "overlap_100mbit_r10_tau5_ahead.json"),
    ),
    readme(
        "streaming bpb at 100 Mbit/s",
        r"of the whole run at ([+\-−][\d.]+)% bpb against\s+blocking",
        TAU5_AHEAD + list(BLOCKING_FILES),
        lambda: median_vs_blocking(TAU5_AHEAD),
    ),
    readme(
        "blocking utilization at 10 Mbit/s",
        r"\(blocking: ([\d.]+)%\)",
        [M + "overlap_10mbit_r10.json"],
        lambda: utilization(M + "overlap_10mbit_r10.json", "blocking"),
    ),
    readme(
        "streaming utilization at 10 Mbit/s",
        r"they compute ([\d.]+)% of the\s+whole run",
        FREEZE_10MBIT,
        lambda: statistics.median(utilization(f) for f in FREEZE_10MBIT),
    ),
    readme(
        "streaming bpb at 10 Mbit/s",
        r"they compute [\d.]+% of the\s+whole run at ([+\-−][\d.]+)%",
        FREEZE_SEEDS + list(BLOCKING_FILES),
        lambda: median_vs_blocking(FREEZE_SEEDS),
    ),
    readme(
        "streaming over 30 rounds, sync.merge=delta",
        r"`sync.merge=delta` keeps ([+\-−][\d.]+)%",
        [M + "overlap_r30_loopback_tau5_delta_int4down_balanced.json", BLOCKING_R30],
        lambda: pct(bpb(M + "overlap_r30_loopback_tau5_delta_int4down_balanced.json"), bpb(BLOCKING_R30)),
    ),
    readme(
        "streaming over 30 rounds, sync.merge=ahead",
        r"`ahead` ([+\-−][\d.]+)% \(one seed\)",
        [M + "overlap_10mbit_r30_tau5_ahead_int4down_balanced.json", BLOCKING_R30],
        lambda: pct(bpb(M + "overlap_10mbit_r30_tau5_ahead_int4down_balanced.json"), bpb(BLOCKING_R30)),
    ),
    readme(
        "eager's bpb",
        r"costs far more quality \(([+\-−][\d.]+)%\)",
        [M + "overlap_10mbit_r10.json"],
        lambda: pct(bpb(M + "overlap_10mbit_r10.json", "eager"), bpb(M + "overlap_10mbit_r10.json", "blocking")),
    ),
    # README.md, "Further reading"
    readme(
        "DiLoCo against data parallel, Python docs, 60 rounds",
        r"DiLoCo ends ([+\-−][\d.]+)% of data parallel at 60 rounds",
        [PYDOCS60],
        lambda: pct(quality_runs(PYDOCS60, "diloco")[0]["final_eval_bpb"], quality_runs(PYDOCS60, "ddp")[0]["final_eval_bpb"]),
    ),
    readme("H200 MFU, eager", r"MFU ([\d.]+)% eager", [H200], lambda: 100 * gpu("bench_base_bf16", "mfu")),
    readme("H200 MFU, compiled", r"([\d.]+)% compiled", [H200], lambda: 100 * gpu("bench_base_bf16_compile", "mfu")),
    # docs/results.md, "Headlines"
    results(
        "Blocking DiLoCo at 100 Mbit/s, 50 ms: compute utilization",
        [M + "overlap_100mbit_r10_tau7_ahead.json"],
        lambda: utilization(M + "overlap_100mbit_r10_tau7_ahead.json", "blocking"),
    ),
    results(
        "Streaming at 100 Mbit/s, 50 ms: compute utilization",
        [M + "overlap_100mbit_r10_tau5_ahead.json"],
        lambda: utilization(M + "overlap_100mbit_r10_tau5_ahead.json"),
    ),
    results("Streaming at 100 Mbit/s, 50 ms: bpb against blocking", TAU5_AHEAD + list(BLOCKING_FILES), lambda: median_vs_blocking(TAU5_AHEAD)),
    results(
        "Blocking DiLoCo at 10 Mbit/s, 100 ms: compute utilization",
        [M + "overlap_10mbit_r10.json"],
        lambda: utilization(M + "overlap_10mbit_r10.json", "blocking"),
    ),
    results("Streaming at 10 Mbit/s, 100 ms: compute utilization", FREEZE_10MBIT, lambda: statistics.median(utilization(f) for f in FREEZE_10MBIT)),
    results("Streaming at 10 Mbit/s, 100 ms: bpb against blocking", FREEZE_SEEDS + list(BLOCKING_FILES), lambda: median_vs_blocking(FREEZE_SEEDS)),
    results(
        "Streaming over 30 rounds, `sync.merge=delta`: bpb against blocking",
        [M + "overlap_r30_loopback_tau5_delta_int4down_balanced.json", BLOCKING_R30],
        lambda: pct(bpb(M + "overlap_r30_loopback_tau5_delta_int4down_balanced.json"), bpb(BLOCKING_R30)),
    ),
    results(
        "Streaming over 30 rounds, `sync.merge=ahead`: bpb against blocking",
        [M + "overlap_10mbit_r30_tau5_ahead_int4down_balanced.json", BLOCKING_R30],
        lambda: pct(bpb(M + "overlap_10mbit_r30_tau5_ahead_int4down_balanced.json"), bpb(BLOCKING_R30)),
    ),
    results(
        "Eager at 10 Mbit/s, 100 ms: bpb against blocking",
        [M + "overlap_10mbit_r10.json"],
        lambda: pct(bpb(M + "overlap_10mbit_r10.json", "eager"), bpb(M + "overlap_10mbit_r10.json", "blocking")),
    ),
    results(
        "Striping, 200 Mbit/s, 100 ms, a 1 MiB window: 4 streams against 1",
        [M + "striping_200mbit_window1m.json"],
        lambda: striping_speedup(M + "striping_200mbit_window1m.json", 4),
    ),
    results(
        "Striping, 1 Gbit/s, 100 ms, a 2 MiB window: 8 streams against 1",
        [M + "striping_1gbit_window2m.json"],
        lambda: striping_speedup(M + "striping_1gbit_window2m.json", 8),
    ),
    results(
        "DiLoCo against data parallel, Python docs, 60 rounds",
        [PYDOCS60],
        lambda: pct(quality_runs(PYDOCS60, "diloco")[0]["final_eval_bpb"], quality_runs(PYDOCS60, "ddp")[0]["final_eval_bpb"]),
    ),
    results("DiLoCo, shipped corpus, 60 rounds: held-out bpb", [R60], lambda: quality_runs(R60, "diloco")[0]["final_eval_bpb"]),
    results("DiLoCo's bytes up per round (fp32, 4 sites, `model=tiny`)", [R60], lambda: bytes_per_round(R60, "diloco")),
    results("Data parallel's bytes per round over DiLoCo's", [PYDOCS60], lambda: bytes_per_round(PYDOCS60, "ddp") / bytes_per_round(PYDOCS60, "diloco")),
    results("The blocking sync's own time, this project", [SYNC], lambda: load(SYNC)["summary"]["ours"]["own_s"]["median"]),
    results("The blocking sync's own time, torchft 0.2.0", [SYNC], lambda: load(SYNC)["summary"]["torchft"]["own_s"]["median"]),
    results("Subnormal floats kept: step time over flushed, last third", [M + "flush_denormal.log"], lambda: flush_denormal_ratio(M + "flush_denormal.log")),
    results(
        "Watching a run (TensorBoard, /metrics, status page): wall time",
        [M + "observe_cost.json"],
        lambda: 100 * (load(M + "observe_cost.json")["ratio_on_off"]["wall_s"] - 1),
    ),
    results("H200, `model=base` bf16: MFU, eager", [H200], lambda: 100 * gpu("bench_base_bf16", "mfu")),
    results("H200, `model=base` bf16: MFU, compiled", [H200], lambda: 100 * gpu("bench_base_bf16_compile", "mfu")),
    results(
        "H200: GPU memory the outer sync adds",
        [H200],
        lambda: load(H200)["summary"]["bench_base_bf16"]["memory_site_minus_plain"]["sync_phase_peak_over_trained_allocated_mb"],
    ),
]


def as_written(written: str, value: float) -> str:
    """``value`` rounded and signed as the doc writes ``written`` (its decimals, sign, commas)."""
    text = written.replace("−", "-")
    decimals = len(text.split(".")[1]) if "." in text else 0
    sign = "+" if text[0] in "+-" else ""
    comma = "," if "," in text else ""
    return f"{value:{sign}{comma}.{decimals}f}"


@pytest.mark.parametrize("figure", FIGURES, ids=[f"{f.doc}: {f.name}" for f in FIGURES])
def test_the_doc_states_what_its_result_file_gives(figure: Figure) -> None:
    text = (ROOT / figure.doc).read_text()
    found = re.search(figure.pattern, text)
    assert found, (
        f"{figure.doc}: the figure '{figure.name}' is no longer where the test looks for it ({figure.pattern!r}); update tests/unit/test_docs_figures.py with the doc"
    )
    number = NUMBER.search(found[1])
    assert number, f"{figure.doc}: '{figure.name}' holds no number: {found[1]!r}"
    written = number[0]
    for f in figure.files:
        assert (ROOT / f).is_file(), f"{figure.doc}: '{figure.name}' names {f}, which is not in the repository"
    expected = as_written(written, figure.compute())
    assert written.replace("−", "-") == expected, (
        f"{figure.doc}: '{figure.name}' says {written}, but {', '.join(figure.files)} give{'s' if len(figure.files) == 1 else ''} {expected}"
    )


def headline_rows() -> list[list[str]]:
    """The cells of each row of docs/results.md's "Headlines" table, its header left out."""
    text = (ROOT / RESULTS).read_text()
    table = text.split("## Headlines", 1)[1].split("\n\n", 2)[1]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in table.splitlines()[2:]]


def test_every_headline_of_results_md_is_checked() -> None:
    names = [cells[0] for cells in headline_rows()]
    assert names, f"{RESULTS}: no Headlines table found"
    checked = {f.name for f in FIGURES if f.doc == RESULTS}
    unchecked = [n for n in names if n not in checked]
    assert not unchecked, f"{RESULTS}: headline rows this test does not check against a committed result file: {unchecked}"


def test_every_result_file_of_the_headlines_exists() -> None:
    for cells in headline_rows():
        name = cells[-1]
        brace = re.search(r"\{([^}]*)\}", name)
        paths = [name[: brace.start()] + part + name[brace.end() :] for part in brace[1].split(",")] if brace else [name]
        for path in paths:
            assert (ROOT / path).is_file(), f"{RESULTS}: the row '{cells[0]}' names {path}, which is not in the repository"
