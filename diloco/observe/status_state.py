"""What the status page shows (``GET /status.json``): the coordinator's state, read through its
public methods (each takes the coordinator's lock for a moment and copies), and the committed
rounds, read from metrics.jsonl as it grows (only the bytes appended since the last read).
metrics.jsonl writes a round's line once the next round is committed (its bytes down are known
then); until then the round comes from the coordinator's recent records, without its bytes
down and evaluation (``"written": false``).

What it reads of the coordinator (this package sits below it) is the ``WatchedCoordinator``
protocol of watched.py, which diloco.coordinator.Coordinator implements.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diloco.observe.watched import WatchedCoordinator

TABLE_ROUNDS = 20  # the rounds table shows the most recent ones
CURVE_POINTS = 1000  # the curves are thinned to about this many points (a long run's JSON stays small)
FRESH_S = 0.5  # requests closer than this share one snapshot (one read of the coordinator)
VERSION = 1


class MetricsTail:
    """The rounds of a metrics.jsonl, read incrementally: complete lines only (a line being
    appended waits for the next read); a line that does not parse is skipped; a file that
    shrank (a restarted coordinator repaired it) is read again from the start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._rounds: dict[int, dict[str, Any]] = {}

    def rounds(self) -> list[dict[str, Any]]:
        """Every committed round's line, by round."""
        try:
            size = self.path.stat().st_size
            if size < self._offset:
                self._offset, self._rounds = 0, {}
            if size > self._offset:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read(size - self._offset)
                end = data.rfind(b"\n") + 1
                self._offset += end
                for raw in data[:end].splitlines():
                    self._take(raw)
        except OSError:
            pass  # not written yet (no round committed), or being replaced: the rounds so far
        return [self._rounds[r] for r in sorted(self._rounds)]

    def _take(self, raw: bytes) -> None:
        try:
            line = json.loads(raw)
            self._rounds[int(line["round"])] = line
        except (ValueError, KeyError, TypeError):
            pass


def _num(value: Any) -> float | None:
    """A finite number as a float, else None (JSON has no NaN: a flush round's train loss is one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _row(m: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a metrics line the page shows (numbers that are not finite as null)."""
    keys = (
        "round",
        "participants",
        "absent",
        "evicted",
        "tokens",
        "train_loss",
        "eval_loss",
        "eval_bpb",
        "bytes_up",
        "bytes_down",
        "wall_s",
        "elapsed_s",
        "rejected",
    )
    return {**{k: _num(m.get(k)) if isinstance(m.get(k), float) else m.get(k) for k in keys}, "written": m.get("written", True)}


def curves(rounds: list[dict[str, Any]], points: int = CURVE_POINTS) -> dict[str, Any]:
    """Per round: train loss, the evaluation (eval_bpb where there is one, else eval_loss), and
    the totals of tokens and payload bytes up and down so far (down: null for a round whose
    bytes down are not known yet); thinned to about ``points`` points (every k-th round and the
    last)."""
    eval_key = "eval_bpb" if any(_num(m.get("eval_bpb")) is not None for m in rounds) else "eval_loss"
    out: dict[str, Any] = {"eval_name": eval_key, "round": [], "tokens": [], "train_loss": [], "eval": [], "bytes_up": [], "bytes_down": []}
    tokens = up = down = 0.0
    stride = max(1, -(-len(rounds) // points))
    for i, m in enumerate(rounds):
        tokens += _num(m.get("tokens")) or 0.0
        up += _num(m.get("bytes_up")) or 0.0
        down += _num(m.get("bytes_down")) or 0.0
        # A round that evaluated is always kept (evaluations are few).
        if i % stride and i != len(rounds) - 1 and _num(m.get(eval_key)) is None:
            continue
        out["round"].append(m.get("round"))
        out["tokens"].append(tokens)
        out["train_loss"].append(_num(m.get("train_loss")))
        out["eval"].append(_num(m.get(eval_key)))
        out["bytes_up"].append(up)
        out["bytes_down"].append(down if _num(m.get("bytes_down")) is not None else None)
    return out


def _sites(states: Mapping[str, Mapping[str, Any]], rounds: list[dict[str, Any]], open_round: int) -> list[dict[str, Any]]:
    """One row per site the coordinator knows or a committed round names: its membership, the
    rounds its push counted in, and its last push (into the open round, with its age; else the
    last committed round that counted it)."""
    counted: dict[str, list[int]] = {}
    for m in rounds:
        for s in m.get("participants") or []:
            counted.setdefault(str(s), []).append(int(m["round"]))
        for p in m.get("merged") or []:
            if isinstance(p, dict) and "site" in p:
                counted.setdefault(str(p["site"]), []).append(int(m["round"]))
    rows = []
    for site in sorted(set(states) | set(counted), key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s)):
        st = states.get(site, {})
        pushed_s_ago = _num(st.get("pushed_s_ago"))
        last = open_round if pushed_s_ago is not None else (max(counted[site]) if site in counted else None)
        rows.append({
            "id": site, "state": st.get("state", "not joined"), "joins": st.get("joins", 0), "rounds": len(counted.get(site, [])),
            "last_push_round": last, "pushed_open_round": pushed_s_ago is not None, "pushed_s_ago": pushed_s_ago,
        })  # fmt: skip
    return rows


class RunState:
    """The snapshot /status.json serves. ``about``: what the run is (sites, H, model, codec: the
    page's header); ``attach`` the coordinator once it exists (until then: ``starting``)."""

    def __init__(self, metrics_path: Path, about: Mapping[str, Any] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.about = dict(about or {})
        self._tail = MetricsTail(metrics_path)
        self._coordinator: WatchedCoordinator | None = None
        self._clock = clock
        self._lock = threading.Lock()  # one snapshot at a time; requests meanwhile share it
        self._cached: tuple[float, bytes] | None = None
        self.started = clock()

    def attach(self, coordinator: WatchedCoordinator) -> None:
        self._coordinator = coordinator

    def json_bytes(self) -> bytes:
        """The snapshot as UTF-8 JSON; one taken less than FRESH_S ago is served again."""
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached[0] >= FRESH_S:
                self._cached = (now, json.dumps(self.snapshot(), allow_nan=False, default=str).encode())
            return self._cached[1]

    def snapshot(self) -> dict[str, Any]:
        run = self._run()
        rounds = self._rounds(int(run["round"]))
        states = self._coordinator.site_states() if self._coordinator is not None else {}
        return {
            "version": VERSION,
            "time": self._clock(),
            "about": self.about,
            "run": run,
            "sites": _sites(states, rounds, int(run["round"])),
            "rounds": [_row(m) for m in rounds[-TABLE_ROUNDS:]],
            "curves": curves(rounds),
        }

    def _rounds(self, committed: int) -> list[dict[str, Any]]:
        """metrics.jsonl's rounds, and the committed rounds it has no line of yet."""
        rounds = self._tail.rounds()
        if self._coordinator is None:
            return rounds
        have = {m.get("round") for m in rounds}
        recent = self._coordinator.recent_records()
        extra = [{**rec, "bytes_down": None, "written": False} for r, rec in recent.items() if r not in have and r < committed]
        return sorted(rounds + extra, key=lambda m: int(m["round"])) if extra else rounds

    def _run(self) -> dict[str, Any]:
        c = self._coordinator
        up = self._clock() - self.started
        if c is None:
            return {"state": "starting", "round": 0, "rounds": None, "run_id": None, "global_sha256": None, "init_from": None, "uptime_s": up}
        committed, total = c.committed_rounds, c.cfg.total_rounds
        failed = c.failed
        state = "failed" if failed else "finished" if c.finished else "running" if c.ready else "waiting for θ₀"
        return {
            "state": state, "failed": failed, "round": committed, "rounds": total, "run_id": c.run_id, "global_sha256": c.global_sha256(),
            "init_from": c.init_from, "uptime_s": up,
        }  # fmt: skip
