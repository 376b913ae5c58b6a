"""Defences against poisoned or broken pseudo-gradients: a bound on each push's norm, and
coordinate-wise robust aggregates (trimmed mean, median) in place of the weighted mean.

Pure math over tensors; the coordinator decides what to do with a verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from diloco.fields import setting
from diloco.outer.aggregate import WEIGHTED, WeightedMean, check_aggregate
from diloco.outer.optimizer import l2

ACTIONS = ("reject", "clip")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RobustConfig:
    """The run config's ``robust:`` section: a bound on each push's norm (off by default) and
    trimmed_mean's trim (the run's ``aggregate`` picks the statistic: diloco.outer.aggregate).
    norm_ratio must be 0 or > 1: the reference is the honest pushes' median, so a ratio ≤ 1
    would refuse about half of them."""

    norm_ratio: float = setting(
        0.0, doc="a push whose ‖Δ‖ exceeds norm_ratio × the median of the last `window` taken pushes' norms is refused or clipped (action); 0: off, else > 1"
    )
    action: str = setting("reject", doc="reject (not counted; the site still gets the round's update) | clip (its Δ scaled down to the bound and taken)")
    window: int = setting(
        16, doc="pushes whose norms make the reference median: the last taken (clipped ones with their clipped norm), this round's and earlier rounds'"
    )
    min_history: int = setting(3, doc="norms known before the bound judges, in 1..window: the first pushes of a run are trusted")
    trim: float = setting(
        0.25, doc="aggregate=trimmed_mean: the share of pushes cut from each end per coordinate, in [0, 0.5) (0.25: one poisoner in four is cut)"
    )

    def __post_init__(self) -> None:
        if not _is_real(self.norm_ratio) or not (self.norm_ratio == 0 or self.norm_ratio > 1):
            raise ValueError(f"robust.norm_ratio={self.norm_ratio!r}: must be 0 (off) or a finite number > 1")
        object.__setattr__(self, "norm_ratio", float(self.norm_ratio))
        if self.action not in ACTIONS:
            raise ValueError(f"robust.action={self.action!r}: must be one of {', '.join(ACTIONS)}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"robust.window={self.window!r}: must be an integer >= 1")
        if not _is_int(self.min_history) or not 1 <= self.min_history <= self.window:
            raise ValueError(f"robust.min_history={self.min_history!r}: must be an integer in [1, robust.window={self.window}]")
        if not _is_real(self.trim) or not 0 <= self.trim < 0.5:
            raise ValueError(f"robust.trim={self.trim!r}: must be a number in [0, 0.5)")
        object.__setattr__(self, "trim", float(self.trim))


def robust_config(d: Mapping[str, Any] | None) -> RobustConfig:
    """A RobustConfig from the plain mapping of the run config's ``robust:`` section (None: defaults)."""
    if d is None:
        return RobustConfig()
    if not isinstance(d, Mapping):
        raise ValueError(f"robust: must be a mapping of its fields, not {type(d).__name__}")
    known = {f.name for f in fields(RobustConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown robust key(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}")
    return RobustConfig(**dict(d))


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """‖Δ‖₂ over all tensors together, accumulated in float64; ``inf`` if any value is NaN or
    infinite (so a broken push is never mistaken for a small one). 0.0 for no tensors."""
    size = l2(delta)
    return size if math.isfinite(size) else math.inf


def judged_size(delta: Mapping[str, torch.Tensor], cfg: RobustConfig) -> float:
    """What ``NormBound.judge`` needs of a push: its norm when the bound is on, else 0.0 (no
    float64 pass over every push for nothing). The wire has already refused non-finite values
    when it decoded the push."""
    return delta_norm(delta) if cfg.norm_ratio else 0.0


@dataclass(frozen=True)
class NormVerdict:
    """What to do with one push. ``scale`` multiplies its Δ (1.0 unless ``clip``);
    ``reference`` is None until ``min_history`` norms are known; ``ratio`` is the bound's
    ``norm_ratio`` (0: off)."""

    action: str  # "take" | "clip" | "reject"
    norm: float
    reference: float | None
    scale: float = 1.0
    ratio: float = 0.0

    @property
    def taken_norm(self) -> float | None:
        """The norm to ``record`` for this push (the clipped one for clip); None if rejected."""
        return None if self.action == "reject" else self.norm * self.scale

    def describe(self) -> str:
        """One sentence with the figures, for the round's log."""
        if not math.isfinite(self.norm):
            return f"rejected: the norm of the push is {self.norm} (a NaN or infinite value)"
        if self.reference is None:
            return f"taken: norm {self.norm:.4g}, trusted while the norm history is short"
        bound = f"{self.ratio:g} × the median of recent norms {self.reference:.4g}"
        if self.action == "take":
            return f"taken: norm {self.norm:.4g}" + (f" within {bound}" if self.ratio > 0 else " (norm bound off)")
        if self.action == "clip":
            return f"clipped: norm {self.norm:.4g} exceeds {bound}; Δ scaled by {self.scale:.4g}"
        return f"rejected: norm {self.norm:.4g} exceeds {bound}"


class NormBound:
    """Judges each push's ‖Δ‖ against the median norm of recently taken pushes.

    The median of a window, not a mean or maximum, so that a few large pushes that slipped in
    (or the first, trusted ones) cannot drag the reference up for long. A non-finite norm is
    always rejected, even with the bound off or a short history.

    The caller ``judge``s a push, and ``record``s ``verdict.taken_norm`` once the push is
    actually taken. ``history`` (oldest first, at most ``window`` floats) goes into checkpoints;
    ``NormBound(cfg, history)`` restores it.
    """

    def __init__(self, cfg: RobustConfig, history: Iterable[float] = ()) -> None:
        self.cfg = cfg
        self._norms: deque[float] = deque(maxlen=cfg.window)
        for norm in history:
            self.record(norm)

    @property
    def history(self) -> list[float]:
        return list(self._norms)

    def reference(self) -> float | None:
        """The median of the recorded norms, or None while fewer than ``min_history`` are known."""
        if len(self._norms) < self.cfg.min_history:
            return None
        return float(statistics.median(self._norms))

    def judge(self, norm: float) -> NormVerdict:
        ratio = self.cfg.norm_ratio
        if not math.isfinite(norm):
            return NormVerdict("reject", norm, self.reference(), ratio=ratio)
        ref = self.reference()
        if ref is None or ratio == 0 or norm <= ratio * ref:
            return NormVerdict("take", norm, ref, ratio=ratio)
        if self.cfg.action == "reject":
            return NormVerdict("reject", norm, ref, ratio=ratio)
        # ref may be 0 (every recent push was all zeros): then the clipped Δ is 0 too.
        return NormVerdict("clip", norm, ref, scale=ratio * ref / norm, ratio=ratio)

    def record(self, norm: float) -> None:
        """Adds a taken push's norm (after clipping) to the history."""
        if not (_is_real(norm) and norm >= 0):
            raise ValueError(f"a recorded norm must be finite and >= 0, got {norm!r}")
        self._norms.append(float(norm))


def stacked_bytes(num_params: int, pushes: int) -> int:
    """Bytes a StackedAggregate holds for ``pushes`` pushes of ``num_params`` float32 values.
    ``mean()`` needs, on top, about 4× one tensor's share of it while it sorts that tensor."""
    if not (_is_int(num_params) and _is_int(pushes) and num_params >= 0 and pushes >= 0):
        raise ValueError(f"num_params={num_params!r}, pushes={pushes!r}: must be integers >= 0")
    return 4 * num_params * pushes


class StackedAggregate:
    """Coordinate-wise trimmed mean or median of the pushes, with WeightedMean's interface.

    It cannot stream: every push is kept as a float32 copy (memory = pushes × parameters × 4
    bytes, see ``stacked_bytes``), because an order statistic needs all values of a coordinate.

    The result is *unweighted*: a weight is the pushing site's own claim of its token count,
    and a poisoner would claim a huge one, so weighting would hand it the aggregate. Weights
    are still checked (> 0) and summed into ``total_weight`` for the round's records.

    Per coordinate the n values are sorted, k = floor(trim × n) are cut from each end and the
    rest averaged in float64; if that would leave fewer than one value, k shrinks so that the
    middle one or two remain, which is the median. The median of an even count is the mean of
    the two middle values. Sorting makes the result the same bits for any push order. NaN
    sorts above +inf, so a trim or median can also shed a few broken values.
    """

    def __init__(self, shapes: Mapping[str, torch.Size], how: str, trim: float = 0.25) -> None:
        if how not in ("trimmed_mean", "median"):
            raise ValueError(f"how={how!r}: must be trimmed_mean or median")
        if not _is_real(trim) or not 0 <= trim < 0.5:
            raise ValueError(f"trim={trim!r}: must be a number in [0, 0.5)")
        self.shapes = {n: torch.Size(s) for n, s in shapes.items()}
        self.how = how
        self.trim = float(trim) if how == "trimmed_mean" else 0.5
        self._pushes: dict[str, list[torch.Tensor]] = {n: [] for n in self.shapes}
        self.total_weight = 0.0
        self.count = 0

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        for name, shape in self.shapes.items():
            if delta[name].shape != shape:
                raise ValueError(f"{name}: shape {tuple(delta[name].shape)}, expected {tuple(shape)}")
        for name, kept in self._pushes.items():
            kept.append(delta[name].detach().to(torch.float32, copy=True))
        self.total_weight += weight
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """The robust aggregate, float32, one tensor per name (a new buffer each call)."""
        if self.count == 0:
            raise ValueError("no contributions to average")
        n = self.count
        k = min(math.floor(self.trim * n), (n - 1) // 2)
        out = {}
        for name, kept in self._pushes.items():
            ordered = torch.sort(torch.stack(kept), dim=0).values
            # -0.0 and 0.0 are equal, so they sort in arrival order; the sum's +0.0 start
            # gives both the same bits (tested).
            out[name] = ordered[k : n - k].double().mean(dim=0).float()
        return out


def make_aggregate(
    shapes: Mapping[str, torch.Size], aggregate: str, trim: float = 0.25, reuse: WeightedMean | StackedAggregate | None = None
) -> WeightedMean | StackedAggregate:
    """The round's accumulator for the run's ``aggregate`` (diloco.outer.aggregate.AGGREGATES):
    a WeightedMean for mean and nonzero, a StackedAggregate (``trim``: trimmed_mean's share
    cut from each end) for the robust statistics. ``reuse``: the previous round's, done with
    (a WeightedMean's buffers are taken over)."""
    check_aggregate(aggregate)
    if aggregate in WEIGHTED:
        return WeightedMean(shapes, aggregate, reuse if isinstance(reuse, WeightedMean) else None)
    return StackedAggregate(shapes, aggregate, trim)
