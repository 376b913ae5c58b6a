"""TensorBoard scalars (torch.utils.tensorboard's SummaryWriter) of a run, under <run dir>/tb/.

- ``RunBoard`` (tb/coordinator): one point per committed round, from the same line that goes
  to metrics.jsonl, at step = the round and again under ``by_tokens/`` at step = the tokens
  of the rounds so far (so runs with other H or batch sizes line up);
- ``SiteBoard`` (tb/site-<id>): every inner step's loss, learning rate and time, at step =
  the site's place in the lr schedule; and per round, at step = the round, the outer sync's
  time split and the site's utilization and stalls so far.

``round_scalars`` is the one list of the coordinator's tags (docs/observability.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

BY_TOKENS = "by_tokens/"
SYNC_PARTS = ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")  # OuterSync.stats.timings, in order


def _writer(directory: Path, flush_s: int) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # imported here: it loads tensorboard

    directory.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(directory), flush_secs=flush_s)


def _plain(line: Any) -> Mapping[str, Any]:
    """A metrics line (diloco.app.records.MetricsLine) or its JSON object, as a mapping."""
    return dataclasses.asdict(line) if dataclasses.is_dataclass(line) else line


def round_scalars(line: Mapping[str, Any], tokens_so_far: int, bytes_so_far: tuple[int, int]) -> dict[str, float]:
    """The coordinator's scalars of one metrics line (tags without the by_tokens/ prefix).
    Values a line does not have (no evaluation this round, bytes_down of a line rewritten
    after a restart) are left out, not written as zeros."""
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        if value is not None and not isinstance(value, bool):
            out[tag] = float(value)

    put("loss/train", line.get("train_loss"))
    put("loss/eval", line.get("eval_loss"))
    put("loss/eval_bpb", line.get("eval_bpb"))
    put("tokens/round", line.get("tokens"))
    put("tokens/total", tokens_so_far)
    put("bytes/up", line.get("bytes_up"))
    put("bytes/down", line.get("bytes_down"))
    put("bytes/up_total", bytes_so_far[0])
    put("bytes/down_total", bytes_so_far[1])
    put("sites/participants", len(line.get("participants") or ()))
    put("sites/absent", len(line.get("absent") or ()))
    put("sites/evicted", len(line.get("evicted") or ()))
    put("pushes/late", len(line.get("late") or ()))  # refused as late: dropped (quorum.late=drop) or too stale to merge
    put("pushes/merged", len(line.get("merged") or ()))
    put("pushes/refused", len(line.get("refused") or ()))  # by the norm bound (robust.norm_ratio)
    put("pushes/clipped", len(line.get("clipped") or ()))
    put("pushes/withheld", len(line.get("withheld") or ()))  # sites that had no Δ for the round
    put("round/rejected", 1.0 if line.get("rejected") else 0.0)
    put("round/inner_steps", line.get("inner_steps"))
    put("norm/update", line.get("update_norm"))
    put("norm/delta", line.get("delta_norm"))
    put("time/round_s", line.get("wall_s"))
    put("time/elapsed_s", line.get("elapsed_s"))
    return out


class RunBoard:
    """tb/coordinator: the run's scalars, one point per committed round.

    ``earlier``: the metrics lines already in metrics.jsonl when the process starts (a
    restarted coordinator), so that the token and byte totals go on where they were."""

    def __init__(self, directory: Path, earlier: Iterable[Mapping[str, Any]] = ()) -> None:
        self.directory = directory
        self._writer = _writer(directory, flush_s=30)
        # Totals of the rounds so far: tokens, bytes up, bytes down (lines come in round order).
        self._totals = [0, 0, 0]
        for d in earlier:
            if "round" in d:
                self._add(d)
        self.points = 0

    def _add(self, d: Mapping[str, Any]) -> None:
        for i, key in enumerate(("tokens", "bytes_up", "bytes_down")):
            self._totals[i] += int(d.get(key) or 0)

    def write(self, line: Any) -> None:
        """One committed round's line (a MetricsLine or its JSON object); flushed at once, so a
        killed coordinator loses no round that metrics.jsonl has."""
        d = _plain(line)
        self._add(d)
        r, (tokens, up, down) = int(d["round"]), self._totals
        for tag, value in round_scalars(d, tokens, (up, down)).items():
            self._writer.add_scalar(tag, value, global_step=r)
            self._writer.add_scalar(BY_TOKENS + tag, value, global_step=tokens)
        self._writer.flush()
        self.points += 1

    def close(self) -> None:
        self._writer.close()


class SiteBoard:
    """tb/site-<id>: a site process's inner steps and outer syncs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._writer = _writer(directory, flush_s=10)

    def step(self, step: int, loss: float, lr: float, step_s: float) -> None:
        """Inner step ``step`` (the site's place in the lr schedule, 0-based)."""
        self._writer.add_scalar("inner/loss", loss, global_step=step)
        self._writer.add_scalar("inner/lr", lr, global_step=step)
        self._writer.add_scalar("inner/step_s", step_s, global_step=step)

    def round(self, round: int, times: Mapping[str, float], totals: Mapping[str, float | None]) -> None:
        """A round that landed: ``times`` is its entry of OuterSync.stats.timings (seconds of
        each part of the sync, and its bytes); ``totals``: the site's figures so far."""
        total = 0.0
        for part in SYNC_PARTS:
            value = float(times.get(part, 0.0))
            total += value
            self._writer.add_scalar(f"sync/{part}", value, global_step=round)
        self._writer.add_scalar("sync/total_s", total, global_step=round)
        for key in ("bytes_up", "bytes_down"):
            if key in times:
                self._writer.add_scalar(f"sync/{key}", float(times[key]), global_step=round)
        for name, value in totals.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(f"site/{name}", float(value), global_step=round)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
