"""The loss-spike guard: a round whose aggregated pseudo-gradient is far larger than usual is
rejected (θ stays, the round is logged with its figures) instead of applied.

A site with a diverged inner phase, corrupt data or a bad restart pushes a Δ many times the
usual size; averaged with the others it still moves θ far. The guard compares the norm of
the round's weighted mean Δ with the median of the last ``window`` accepted rounds' norms,
once ``min_rounds`` of them exist, and rejects it above ``factor`` times that median.
Pure: no clock, no torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from diloco.fields import setting


@dataclass(frozen=True)
class GuardConfig:
    """The run config's ``guard`` section; factor 0 turns the guard off."""

    factor: float = setting(
        0.0, doc="a round whose mean Δ norm exceeds factor × the median of the last `window` accepted rounds' norms is rejected (θ stays); 0: off, else > 1"
    )
    window: int = setting(5, doc="accepted rounds whose Δ norms make the median")
    min_rounds: int = setting(3, doc="accepted rounds needed before the guard judges, in 1..window")

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and (self.factor == 0 or self.factor > 1)):
            raise ValueError(f"guard.factor={self.factor!r}: must be 0 (off) or > 1")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"guard.window={self.window!r}: must be an integer >= 1")
        if not (isinstance(self.min_rounds, int) and 1 <= self.min_rounds <= self.window):
            raise ValueError(f"guard.min_rounds={self.min_rounds!r}: must be an integer in 1..guard.window")


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    norm: float
    median: float | None  # of the recent accepted norms; None while there are too few
    limit: float | None  # factor x median

    def describe(self) -> str:
        if self.limit is None:
            return f"update norm {self.norm:.4g} (guard: too few rounds yet)"
        return f"update norm {self.norm:.4g} vs limit {self.limit:.4g} ({self.limit / self.median:g} x median {self.median:.4g})"


class SpikeGuard:
    def __init__(self, cfg: GuardConfig, history: list[float] | None = None) -> None:
        self.cfg = cfg
        self._norms: deque[float] = deque(history or [], maxlen=cfg.window)

    @property
    def history(self) -> list[float]:
        return list(self._norms)

    def judge(self, norm: float) -> Verdict:
        """Accepts or rejects a round's update norm; accepted norms join the history."""
        median = statistics.median(self._norms) if len(self._norms) >= self.cfg.min_rounds else None
        limit = self.cfg.factor * median if (median is not None and self.cfg.factor) else None
        accepted = not (norm != norm) and (limit is None or norm <= limit)  # a nan norm is never accepted
        if accepted:
            self._norms.append(norm)
        return Verdict(accepted, norm, median, limit)
