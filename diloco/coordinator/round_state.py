"""The open round: what has been pushed into it so far. A fresh ``RoundState`` opens every
round (``RoundState.open``), so nothing of a round outlives it by accident."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.outer import WeightedMean
from diloco.types import PushHeader


@dataclass
class RoundState:
    number: int
    opened_at: float  # the coordinator's clock when the round opened (previous commit or start)
    acc: WeightedMean  # Σ w·Δ of the pushes (and merged late pushes) taken so far
    pushes: dict[str, PushHeader] = field(default_factory=dict)  # site -> its push for this round
    pushed_at: dict[str, float] = field(default_factory=dict)  # site -> arrival time
    bytes_up: int = 0
    merged: list[dict[str, Any]] = field(default_factory=list)  # late pushes merged in: site, round, weight, tokens
    sliced: dict[str, list[dict[str, int]]] = field(default_factory=dict)  # what sharded sites' parts held
    evicted: list[str] = field(default_factory=list)  # sites whose lease ended while the round was open

    @staticmethod
    def open(number: int, opened_at: float, shapes: Mapping[str, torch.Size], aggregate: str) -> RoundState:
        return RoundState(number=number, opened_at=opened_at, acc=WeightedMean(shapes, aggregate))

    def take(self, header: PushHeader, delta: Mapping[str, torch.Tensor], now: float, sliced: list[dict[str, int]] | None) -> None:
        """A push for this round, weighted by its tokens."""
        self.acc.add(delta, float(header.tokens))
        self.pushes[header.site_id] = header
        self.pushed_at[header.site_id] = now
        if sliced is not None:
            self.sliced[header.site_id] = sliced

    def merge(self, header: PushHeader, delta: Mapping[str, torch.Tensor], factor: float) -> None:
        """A late push for an earlier round, weighted by its tokens × ``factor``."""
        self.acc.add(delta, float(header.tokens) * factor)
        self.merged.append({"site": header.site_id, "round": header.round, "weight": factor, "tokens": header.tokens})
