"""The outer optimizer's schedules: its learning rate and momentum as functions of the outer
step k = 0 .. steps-1 (one step per round, or per fragment's round with streaming fragments).

They are pure functions of k and the run's length, so a restarted coordinator, which knows its
round from its checkpoint, sets exactly the values the first one would have: nothing of the
schedules needs saving.

    lr(k)        = lr · (k+1) / W_lr                              for k < W_lr (warm-up)
                 = lr_min + (lr − lr_min) · d((k − W_lr) / (steps − W_lr))   after it,
    momentum(k)  = momentum · k / W_m                             for k < W_m
                 = momentum                                       after it,

with d(q) = 1 (``none``), 1 − q (``linear``) or (1 + cos πq) / 2 (``cosine``), and
lr_min = lr · ``lr_min_ratio``. q < 1 at every step, so the last step still moves θ. A momentum
warm-up starts at 0: the first outer steps are plain averaging steps, which is what short runs
need (docs/outer.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("none", "linear", "cosine")


@dataclass(frozen=True)
class OuterSchedule:
    """``lr_warmup`` and ``momentum_warmup``: outer steps to reach the full value (0: none);
    ``lr_decay``: none | linear | cosine after the warm-up, towards ``lr_min_ratio`` · lr."""

    lr_warmup: int = 0
    lr_decay: str = "none"
    lr_min_ratio: float = 0.0
    momentum_warmup: int = 0

    def __post_init__(self) -> None:
        for name in ("lr_warmup", "momentum_warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"outer.{name}={value!r}: must be an integer >= 0 (outer steps)")
        if self.lr_decay not in DECAYS:
            raise ValueError(f"outer.lr_decay={self.lr_decay!r}: must be one of {', '.join(DECAYS)}")
        ratio = self.lr_min_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
            raise ValueError(f"outer.lr_min_ratio={ratio!r}: must be a number in [0, 1]")

    @property
    def active(self) -> bool:
        return self.lr_warmup > 0 or self.lr_decay != "none" or self.momentum_warmup > 0

    def check_length(self, steps: int) -> None:
        """Refuses warm-ups that do not fit in a run of ``steps`` outer steps, naming the field."""
        for name in ("lr_warmup", "momentum_warmup"):
            value = getattr(self, name)
            if value > steps:
                raise ValueError(f"outer.{name}={value}: longer than the run's {steps} outer steps (rounds)")

    def lr(self, base: float, k: int, steps: int) -> float:
        """The learning rate of outer step ``k`` of ``steps``."""
        if k < self.lr_warmup:
            return base * (k + 1) / self.lr_warmup
        if self.lr_decay == "none":
            return base
        q = (k - self.lr_warmup) / max(steps - self.lr_warmup, 1)
        q = min(max(q, 0.0), 1.0)
        d = 1.0 - q if self.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * q))
        low = base * self.lr_min_ratio
        return low + (base - low) * d

    def momentum(self, base: float, k: int) -> float:
        """The momentum of outer step ``k``."""
        if k < self.momentum_warmup:
            return base * k / self.momentum_warmup
        return base
