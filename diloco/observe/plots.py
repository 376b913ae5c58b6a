"""Plots of runs (matplotlib, drawn by the Agg backend on Figure objects, never pyplot: no
display and no global state): the held-out figure and the train loss against tokens, the
held-out figure against the bytes communicated, and a per-site timeline of rounds.

``plot_run`` writes one run's into ``<run_dir>/plots/`` (diloco-sim calls it at the end of
every simulation); ``plot_runs`` draws several runs on the same axes (diloco-report).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from diloco.observe.rundata import RunData, load_run
from diloco.observe.timeline import EVENTS, STATES, timeline
from diloco.run_dir import RunDir

CURVES = ("eval_vs_tokens", "train_loss_vs_tokens", "eval_vs_bytes")
DPI = 120

_STATE_COLORS = {"pushed": "#4caf50", "absent": "#c8c8c8", "evicted": "#ff9800"}
_EVENT_STYLE = {  # marker, colour
    "late": ("o", "#1f77b4"),
    "dropped": ("x", "#d62728"),
    "refused": ("s", "#8c1c13"),
    "withheld": ("D", "#7f7f7f"),
    "killed": ("X", "#000000"),
    "rejoined": ("^", "#9467bd"),
    "fault": ("*", "#e6b800"),
}


def _eval_label(key: str) -> str:
    return "held-out bits per byte (eval_bpb)" if key == "eval_bpb" else "held-out loss, nats per token (eval_loss)"


def _save(fig: Figure, path: Path) -> Path:
    """Renders with Agg and writes ``path`` atomically (a reader never sees half a file)."""
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, dpi=DPI, format="png")
    os.replace(tmp, path)
    return path


def _curve(ax, runs: Sequence[RunData], labels: Sequence[str], what: str) -> None:  # type: ignore[no-untyped-def]
    """One of CURVES on ``ax``, every run a line."""
    key = "train_loss" if what == "train_loss_vs_tokens" else _eval_key(runs)
    left_out = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        points = run.points("train_loss" if key == "train_loss" else run.eval_metric)
        if what == "eval_vs_bytes":
            shown = [p for p in points if p.bytes > 0]
            if points and not shown:
                left_out.append(label)
            points = shown
        if not points:
            continue
        xs = [p.bytes if what == "eval_vs_bytes" else p.tokens for p in points]
        ax.plot(xs, [p.value for p in points], marker="o", markersize=3.5, linewidth=1.4, label=label, color=f"C{i % 10}")  # a run's colour in every panel
    if what == "eval_vs_bytes":
        ax.set_xscale("log")
        ax.set_xlabel("bytes communicated (payload up + down, cumulative; log scale)")
    else:
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set_xlabel("tokens (committed rounds, cumulative)")
    ax.set_ylabel("train loss, nats per token" if key == "train_loss" else _eval_label(key))
    title = {"eval_vs_tokens": "held-out vs tokens", "train_loss_vs_tokens": "train loss vs tokens", "eval_vs_bytes": "held-out vs bytes communicated"}[what]
    ax.set_title(title)
    if left_out:
        ax.text(0.02, 0.02, "not shown (no bytes communicated): " + "; ".join(left_out), transform=ax.transAxes, fontsize=7, color="#555555")
    if not ax.lines:
        ax.text(
            0.5,
            0.5,
            "no points (nothing evaluated)" if key != "train_loss" else "no train loss recorded",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="#555555",
        )
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines and len(runs) > 1:
        ax.legend(fontsize=7)


def _eval_key(runs: Sequence[RunData]) -> str:
    keys = {r.eval_metric for r in runs}
    return keys.pop() if len(keys) == 1 else "eval_bpb"


def run_labels(runs: Sequence[RunData], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(runs):
            raise ValueError(f"{len(labels)} label(s) for {len(runs)} run(s): give one --label per run")
        return list(labels)
    out = [r.label() for r in runs]
    if len(set(out)) < len(out):  # the same settings twice: tell them apart by directory
        out = [f"{label} ({r.path.name})" for label, r in zip(out, runs)]
    return out


def draw_curves(runs: Sequence[RunData], out_dir: Path, labels: Sequence[str] | None = None) -> list[Path]:
    """CURVES as one file each, and overview.png with the three side by side, for ``runs``
    on the same axes."""
    names = run_labels(runs, labels)
    written = []
    for what in CURVES:
        fig = Figure(figsize=(6.4, 4.4), layout="constrained")
        _curve(fig.add_subplot(), runs, names, what)
        written.append(_save(fig, out_dir / f"{what}.png"))
    fig = Figure(figsize=(17, 4.8), layout="constrained")
    for i, what in enumerate(CURVES):
        _curve(fig.add_subplot(1, 3, i + 1), runs, names, what)
    if len(runs) == 1:
        fig.suptitle(f"{names[0]} ({runs[0].path.name})")
    written.append(_save(fig, out_dir / "overview.png"))
    return written


def draw_timeline(run: RunData, path: Path) -> Path:
    """Per site (rows) and round (columns): pushed / absent / evicted cells, with markers for
    late, dropped, refused, killed, rejoined and other injected faults."""
    t = timeline(run)
    rows = t.rows or ["-"]
    fig = Figure(figsize=(min(20.0, max(7.0, 4.0 + 0.12 * len(t.rounds))), max(2.8, 1.4 + 0.42 * len(rows))), layout="constrained")
    ax = fig.add_subplot()
    y = {row: i for i, row in enumerate(rows)}
    for state in STATES:
        for row in rows:
            cells = [(r - 0.45, 0.9) for r in t.rounds if t.states.get((row, r)) == state]
            if cells:
                ax.broken_barh(cells, (y[row] - 0.35, 0.7), facecolors=_STATE_COLORS[state])
    for event in EVENTS:
        xs, ys = [], []
        for (row, r), kinds in t.events.items():
            if event in kinds:
                offset = (kinds.index(event) - (len(kinds) - 1) / 2) * 0.3
                xs.append(r + offset)
                ys.append(y[row])
        if xs:
            marker, color = _EVENT_STYLE[event]
            ax.scatter(xs, ys, marker=marker, color=color, s=36, zorder=3, linewidths=1.5)
    handles = [_patch(_STATE_COLORS[s], f"{s} ({t.count(s)})") for s in STATES if t.count(s)]
    handles += [_marker(*_EVENT_STYLE[e], f"{e} ({t.count(e)})") for e in EVENTS if t.count(e)]
    ax.set_yticks(range(len(rows)), [r if r == "coordinator" else f"site {r}" for r in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.invert_yaxis()
    if t.rounds:
        ax.set_xlim(min(t.rounds) - 0.7, max(t.rounds) + 0.7)
    ax.set_xlabel("round")
    ax.set_title(f"rounds per site: {run.label()}")
    ax.grid(True, axis="x", alpha=0.25)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def _patch(color: str, label: str):  # type: ignore[no-untyped-def]
    from matplotlib.patches import Patch

    return Patch(facecolor=color, label=label)


def _marker(marker: str, color: str, label: str):  # type: ignore[no-untyped-def]
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle="none", marker=marker, color=color, markersize=7, label=label)


def plot_run(run_dir: Path | str) -> list[Path]:
    """One run's plots into ``<run_dir>/plots/``: the curves, overview.png and timeline.png.
    RunDirError when ``run_dir`` is not a run with committed rounds."""
    run = load_run(run_dir)
    out = RunDir(run.path).plots_dir
    return draw_curves([run], out) + [draw_timeline(run, out / "timeline.png")]


def plot_runs(runs: Sequence[RunData], out_dir: Path, labels: Sequence[str] | None = None) -> list[Path]:
    """Several runs on the same axes into ``out_dir`` (diloco-report)."""
    return draw_curves(runs, out_dir, labels)
