"""Live progress on the terminal: the open round's inner steps across sites, with ETAs.

A tqdm bar when the stream it draws on (stderr) is a terminal; otherwise plain lines, at most
one every ``every_s`` seconds, through the process's log, so that log files and CI output stay
readable (no carriage returns, no escape codes). The caller says where each site is (a
``SiteStep``: the round its inner phase trains for and the steps done of it); this module keeps
the rates and draws. diloco-sim reads the sites' progress files (``read_positions``); a
standalone site tells its own steps as it takes them.

Log lines written while a bar is shown go above it: the caller's through ``say``, every other
logging record through tqdm's logging redirect (the console handler's format is kept).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from diloco.fields import setting
from diloco.observe.config import parse_section

MODES = ("auto", "bar", "lines", "off")
RATE_WINDOW_S = 30.0  # the recent rate (round ETA) is measured over this many seconds
DRAW_EVERY_S = 0.2  # a bar is redrawn at most this often (a fast inner loop calls on every step)


@dataclass(frozen=True)
class ProgressConfig:
    """The ``progress`` section of diloco-sim and diloco-site: live progress on the terminal."""

    mode: str = setting("auto", doc="auto (a bar when stderr is a terminal, else plain lines) | bar | lines | off")
    every_s: float = setting(5.0, doc="plain lines at most this often, in seconds (a line only when something moved)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"progress.mode={self.mode!r}: must be one of {', '.join(MODES)}")
        if isinstance(self.every_s, bool) or not isinstance(self.every_s, (int, float)) or not (math.isfinite(self.every_s) and self.every_s >= 0):
            raise ValueError(f"progress.every_s={self.every_s!r}: must be a number of seconds >= 0")


OFF = ProgressConfig(mode="off")


def progress_config(values: Mapping[str, Any] | None) -> ProgressConfig:
    """The ``progress`` section (plain data) as a ProgressConfig; unknown keys are named."""
    return parse_section(ProgressConfig, "progress", values)


@dataclass(frozen=True)
class SiteStep:
    """Where one site is: its inner phase trains for ``round`` and has done ``step`` of its
    ``steps`` steps (0 steps: a flush round)."""

    round: int
    step: int
    steps: int


@dataclass(frozen=True)
class ProgressState:
    """What is shown: the open round (0-based) of ``rounds``, ``done`` of its ``total`` inner
    steps across sites, the recent rate (steps per second, all sites together) and the ETAs."""

    round: int
    rounds: int
    done: int
    total: int
    rate: float | None
    round_eta_s: float | None
    run_eta_s: float | None

    @property
    def finished(self) -> bool:
        return self.round >= self.rounds

    def describe(self) -> str:
        """Round, steps and ETAs on one line, without a bar: what a plain progress line says."""
        if self.finished:
            return f"round {self.rounds}/{self.rounds} committed"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = f"{self.rate:.1f} steps/s" if self.rate else "- steps/s"
        return f"round {self.round + 1}/{self.rounds}  {self.done}/{self.total} steps{pct}  {rate}  {self.etas()}"

    def etas(self) -> str:
        return f"round ETA {format_eta(self.round_eta_s)}  run ETA {format_eta(self.run_eta_s)}"


def format_eta(seconds: float | None) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour); ``?`` when not known yet."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressTracker:
    """Rates and ETAs from successive observations; the clock is the caller's (pure).

    A site's place in the run is the steps of the rounds before its phase's plus the steps of
    its phase (a site started again after a crash joins where the run is, so this never counts
    lost work twice). The round ETA divides the open round's steps still to go by the recent
    rate (the last ``window_s`` seconds); the run ETA divides the run's steps still to go by the
    rate since the first step seen, outer syncs included."""

    def __init__(
        self, rounds: int, sites: int, round_steps: int, train_rounds: int | None = None, window_s: float = RATE_WINDOW_S, early: tuple[int, ...] = ()
    ) -> None:
        self.rounds, self.sites, self.round_steps = rounds, sites, round_steps
        self.train_rounds = rounds if train_rounds is None else train_rounds  # later rounds are flush rounds (no steps)
        self.early = tuple(early)  # the steps of the first rounds (sync.schedule)
        self.window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._first: tuple[float, int] | None = None

    def steps_of(self, round: int) -> int:
        if round < len(self.early):
            return self.early[round]
        return self.round_steps if round < self.train_rounds else 0

    def _before(self, round: int) -> int:
        n = min(round, len(self.early))
        return sum(self.early[:n]) + max(0, min(round, self.train_rounds) - n) * self.round_steps

    def _place(self, at: SiteStep) -> int:
        return self._before(at.round) + min(at.step, self.steps_of(at.round))

    def update(self, now: float, committed: int, sites: Mapping[str, SiteStep]) -> ProgressState:
        """``committed``: the rounds committed as far as the caller knows (diloco-sim: the lines
        of metrics.jsonl, which come a round late). The round shown is the one the furthest
        site's inner phase trains for, until the last round is committed; a site behind it
        (syncing, or started again and not joined yet) has done none of its steps."""
        open_round = committed if committed >= self.rounds else max(committed, max((at.round for at in sites.values()), default=0))
        per_site = self.steps_of(open_round)
        total = per_site * max(self.sites, len(sites))
        done = sum(min(at.step, per_site) if at.round == open_round else 0 for at in sites.values())
        place = sum(self._place(at) for at in sites.values())
        if self._first is None and place > 0:
            self._first = (now, place)  # the rates count from the first step seen (not from sites not started yet)
        if self._first is not None:
            self._recent.append((now, place))
        while len(self._recent) > 2 and now - self._recent[1][0] >= self.window_s:
            self._recent.popleft()
        rate = _rate(self._recent[0], (now, place)) if self._recent else None
        overall = _rate(self._first, (now, place)) if self._first is not None else None
        run_total = self._before(self.train_rounds) * max(self.sites, len(sites))
        return ProgressState(
            round=open_round, rounds=self.rounds, done=done, total=total, rate=rate,
            round_eta_s=(total - done) / rate if rate else (0.0 if total and done >= total else None),
            run_eta_s=max(0, run_total - place) / overall if overall else None,
        )  # fmt: skip


def _rate(a: tuple[float, int] | None, b: tuple[float, int]) -> float | None:
    if a is None or b[0] <= a[0] or b[1] <= a[1]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


def read_positions(progress_dir: Path) -> dict[str, SiteStep]:
    """Site -> where it is, from ``progress/<site>.<incarnation>.json`` (the newest incarnation
    of each site; ``round``, ``step``, ``steps`` of diloco.app.records.ProgressRecord). A file
    being replaced or without those fields is passed over until the next call."""
    newest: dict[str, tuple[int, Path]] = {}
    for path in progress_dir.glob("*.json") if progress_dir.is_dir() else ():
        site, _, incarnation = path.stem.rpartition(".")
        if site and incarnation.isdigit() and int(incarnation) >= newest.get(site, (-1, path))[0]:
            newest[site] = (int(incarnation), path)
    out = {}
    for site, (_, path) in sorted(newest.items()):
        try:
            d = json.loads(path.read_text())
            out[site] = SiteStep(int(d["round"]), int(d["step"]), int(d["steps"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def is_terminal(stream: Any) -> bool:
    """``stream`` is an interactive terminal that can redraw a line (not TERM=dumb)."""
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


class LiveProgress:
    """Shows a run's (or one site's) progress: ``update`` with where the sites are, ``say``
    for the lines that must go above the bar, ``close`` (or ``with``) at the end.

    ``log``: the process's log (plain lines go there); ``label``: what the bar and the lines
    are of (``sites``, ``site 0``); ``stream``: where the bar is drawn (stderr)."""

    def __init__(
        self, cfg: ProgressConfig, log: Callable[[str], None], tracker: ProgressTracker, *, label: str = "sites", stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.cfg, self.log, self.tracker, self.label, self.clock = cfg, log, tracker, label, clock
        self.stream = stream if stream is not None else sys.stderr
        self.bar_mode = cfg.mode == "bar" or (cfg.mode == "auto" and is_terminal(self.stream))
        self.lines_mode = cfg.mode == "lines" or (cfg.mode == "auto" and not self.bar_mode)
        self._bar: Any = None
        self._redirect: Any = None
        self._bar_round: int | None = None
        self._seen = self._said = -math.inf
        self._seen_round: int | None = None
        self._last: tuple[int, int] | None = None
        self.state: ProgressState | None = None

    @property
    def enabled(self) -> bool:
        return self.bar_mode or self.lines_mode

    def update(self, committed: int, sites: Mapping[str, SiteStep], *, force: bool = False) -> None:
        """Where the sites are now; ``committed``: the rounds committed as far as the caller knows
        (a site: the round it trains for). Calls closer than DRAW_EVERY_S apart with the same
        ``committed`` are passed over unless ``force`` (a phase's last step)."""
        if not self.enabled:
            return
        now = self.clock()
        if not force and committed == self._seen_round and now - self._seen < DRAW_EVERY_S:
            return
        self._seen, self._seen_round = now, committed
        state = self.state = self.tracker.update(now, committed, sites)
        if self.bar_mode:
            self._draw(state, now)
        elif (state.round, state.done) != self._last and now - self._said >= self.cfg.every_s and (sites or state.round > 0):
            self._last, self._said = (state.round, state.done), now
            self.log(f"progress: {self.label} {state.describe()}")

    def _draw(self, state: ProgressState, now: float) -> None:
        total, done = max(state.total, 1), state.done if state.total else (1 if state.finished else 0)
        desc = f"{self.label} round {min(state.round + 1, state.rounds)}/{state.rounds}"
        rate = f"{state.rate:.1f} steps/s, " if state.rate else ""
        if self._bar is None:
            self._open_bar(desc, total, done, f"{rate}{state.etas()}")
        elif state.round != self._bar_round:
            self._bar.reset(total=total)  # a new round: its own steps, its own elapsed time
            self._bar.set_description_str(desc, refresh=False)
        self._bar_round = state.round
        bar = self._bar
        bar.total, bar.n = total, done
        bar.set_postfix_str(f"{rate}{state.etas()}", refresh=False)
        bar.refresh()

    def _open_bar(self, desc: str, total: int, done: int, postfix: str) -> None:
        from tqdm import tqdm  # only where a bar is drawn
        from tqdm.contrib.logging import logging_redirect_tqdm

        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]"
        self._bar = tqdm(desc=desc, total=total, initial=done, file=self.stream, leave=False, dynamic_ncols=True, bar_format=fmt, postfix=postfix)
        if _console_handler() is not None:
            # Records from any thread go above the bar, in the console handler's format.
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def say(self, message: str) -> None:
        """A line of the process's log, written above the bar when one is shown."""
        if self._bar is None:
            self.log(message)
            return
        with self._bar.external_write_mode(file=self.stream):
            self.log(message)

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> LiveProgress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _console_handler() -> logging.Handler | None:
    """The root logger's handler that writes to stdout or stderr (diloco.observe.logs' one)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr):
            return h
    return None
