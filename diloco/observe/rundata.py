"""A run directory read for plots and reports: its curves and its final figures.

Reads the files as plain JSON (metrics.jsonl, summary.json, config.json, global.json,
workers/*.json, faults.jsonl; their fields: diloco/app/records.py), so it works on the run
directories of every mode (diloco, ddp, single), of a diloco-sim run and of a real
coordinator's, and on older runs whose records lack a field or two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.io import read_jsonl_tolerant
from diloco.run_dir import RunDir


class RunDirError(ValueError):
    """A path that cannot be read as a run; the message names it."""


@dataclass
class Point:
    round: int
    tokens: int  # tokens in committed rounds so far, this round's included
    bytes: int  # payload bytes up and down so far, this round's included
    elapsed_s: float
    value: float


@dataclass
class RunData:
    path: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    global_record: dict[str, Any] | None = None
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)

    def _setting(self, key: str, default: Any = None) -> Any:
        for source in (self.summary, self.config):
            if source and source.get(key) is not None:
                return source[key]
        return default

    @property
    def mode(self) -> str:
        return str(self._setting("mode", "diloco"))

    @property
    def sites(self) -> int:
        return int(self._setting("sites", len(self.site_ids)))

    @property
    def sync_every(self) -> int | None:
        h = self._setting("sync_every")  # summary.json's; config.json has it as sync.every
        if h is None:
            h = ((self.config or {}).get("sync") or {}).get("every")
        return int(h) if h is not None else None

    @property
    def codec(self) -> str:
        """The uplink codec (ddp and single: '-', they all-reduce fp32 gradients or send nothing)."""
        if self.mode != "diloco":
            return "-"
        if self.summary and self.summary.get("codec"):
            return str(self.summary["codec"])
        codec = (self.config or {}).get("codec")
        return str(codec.get("name", "?")) if isinstance(codec, dict) else "?"

    @property
    def eval_metric(self) -> str:
        """eval_bpb where the run has it (bytes data), else eval_loss (nats per token)."""
        return (
            "eval_bpb"
            if any(m.get("eval_bpb") is not None for m in self.metrics) or not any(m.get("eval_loss") is not None for m in self.metrics)
            else "eval_loss"
        )

    @property
    def site_ids(self) -> list[str]:
        """Every site (ranks in the baselines) the run configured or its records name, in order."""
        ids: set[str] = set(self.workers)
        configured = self._setting("sites")
        if configured is not None:
            ids |= {str(i) for i in range(int(configured) if self.mode != "single" else 1)}
        for m in self.metrics:
            ids |= set(map(str, m.get("participants", []))) | set(map(str, m.get("absent", []))) | set(map(str, m.get("evicted", [])))
            ids |= {str(p["site"]) for key in ("late", "merged") for p in m.get(key, []) if "site" in p}
        return sorted(ids, key=lambda s: (0, int(s), "") if s.isdigit() else (1, 0, s))

    def points(self, key: str) -> list[Point]:
        """``key`` (train_loss, eval_bpb, eval_loss, ...) per committed round where it is set,
        with the tokens and bytes up to and including that round."""
        out, tokens, moved = [], 0, 0
        for m in self.metrics:
            tokens += int(m.get("tokens") or 0)
            moved += int(m.get("bytes_up") or 0) + int(m.get("bytes_down") or 0)
            if m.get(key) is not None:
                out.append(Point(int(m["round"]), tokens, moved, float(m.get("elapsed_s") or 0.0), float(m[key])))
        return out

    @property
    def tokens(self) -> int:
        return sum(int(m.get("tokens") or 0) for m in self.metrics)

    @property
    def bytes_total(self) -> int:
        """Payload bytes up and down over the run."""
        return sum(int(m.get("bytes_up") or 0) + int(m.get("bytes_down") or 0) for m in self.metrics)

    @property
    def final_eval(self) -> float | None:
        """The final θ's held-out figure (eval_metric): the summary's or the coordinator's
        report's, else the last evaluated round's."""
        key = "final_" + self.eval_metric
        for source in (self.summary, self.global_record):
            if source and source.get(key) is not None:
                return float(source[key])
        points = self.points(self.eval_metric)
        return points[-1].value if points else None

    @property
    def wall_s(self) -> float | None:
        for source in (self.summary, self.global_record):
            if source and source.get("wall_s") is not None:
                return float(source["wall_s"])
        return float(self.metrics[-1]["elapsed_s"]) if self.metrics and self.metrics[-1].get("elapsed_s") is not None else None

    def finals(self) -> dict[str, Any]:
        """The run's final figures, one row of diloco-report's table."""
        return {
            "run": str(self.path), "mode": self.mode, "sites": self.sites, "H": self.sync_every, "codec": self.codec,
            "rounds": len(self.metrics), "tokens": self.tokens, "bytes": self.bytes_total,
            f"final_{self.eval_metric}": self.final_eval, "wall_s": self.wall_s,
        }  # fmt: skip

    def label(self) -> str:
        """A short name for a legend: mode, sites, H and codec."""
        if self.mode == "single":
            return f"single worker, {self.sync_every}-step blocks"
        if self.mode == "ddp":
            return f"ddp, {self.sites} ranks"
        return f"diloco, {self.sites} sites, H={self.sync_every}, {self.codec}"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror})") from None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # a torn last line (a killed writer)
            raise RunDirError(f"{path} line {n}: not valid JSON") from None
        if not isinstance(d, dict) or "round" not in d:
            raise RunDirError(f"{path} line {n}: not a metrics line (no 'round')")
        out.append(d)
    return out


def load_run(path: Path | str) -> RunData:
    """The run in ``path``; RunDirError naming the path when it is not a run directory or has
    no committed round to show."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"{path}: no such directory")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory (give a run directory: the one holding metrics.jsonl and summary.json)")
    rd = RunDir(path)
    markers = (rd.metrics, rd.summary, rd.config, rd.global_record)
    if not any(m.exists() for m in markers):
        raise RunDirError(f"{path}: not a run directory (none of {', '.join(m.name for m in markers)} in it)")
    if not rd.metrics.exists():
        raise RunDirError(
            f"{path}: no metrics.jsonl, so nothing to plot: the run committed no round yet, or this is a site's run directory (the coordinator's holds metrics.jsonl)"
        )
    metrics = _jsonl(rd.metrics)
    if not metrics:
        raise RunDirError(f"{path}: metrics.jsonl holds no committed round")
    optional = {name: _json(f) if f.exists() else None for name, f in (("summary", rd.summary), ("config", rd.config), ("global", rd.global_record))}
    workers = {p.stem: _json(p) for p in sorted(rd.workers_dir.glob("*.json"))} if rd.workers_dir.is_dir() else {}
    # The fault events that fired: summary.json's list, else (a run that did not finish) faults.jsonl.
    faults = list(optional["summary"].get("faults_injected") or []) if optional["summary"] else read_jsonl_tolerant(rd.faults_fired)
    return RunData(path, metrics, summary=optional["summary"], config=optional["config"], global_record=optional["global"], workers=workers, faults=faults)
