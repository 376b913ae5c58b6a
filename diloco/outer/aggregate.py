"""Token-weighted mean of the sites' pseudo-gradients, accumulated in one buffer."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class WeightedMean:
    """Accumulates Σ w_s·Δ_s and Σ w_s; memory is one float64 copy of the parameters,
    however many sites contribute. Weights are the tokens each site processed.

    Why float64: pushes arrive in any order and float32 addition is not associative, so a
    float32 sum would make the same run give different θ from one run to the next. In
    float64, w·Δ is exact (a 24-bit mantissa times an integer weight below 2^29) and the
    order only moves the sum by ~1e-16 relative, which the final rounding of the mean to
    float32 removes except in vanishingly rare ties (tests/test_outer_math.py checks this).
    """

    def __init__(self, shapes: Mapping[str, torch.Size]) -> None:
        self._sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
        self.total_weight = 0.0
        self.count = 0

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        for name, buf in self._sum.items():
            buf.add_(delta[name].double(), alpha=weight)
        self.total_weight += weight
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise ValueError("no contributions to average")
        return {n: (s / self.total_weight).float() for n, s in self._sum.items()}
