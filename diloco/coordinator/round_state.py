"""The open round: what has been pushed into it so far. A fresh ``RoundState`` opens every
round (``RoundState.open``), so nothing of a round outlives it by accident."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.outer import NormVerdict, StackedAggregate, WeightedMean, make_aggregate
from diloco.types import PushHeader


@dataclass
class RoundState:
    number: int
    opened_at: float  # the coordinator's clock when the round opened (previous commit or start)
    acc: WeightedMean | StackedAggregate  # the pushes (and merged late pushes) counted so far
    pushes: dict[str, PushHeader] = field(default_factory=dict)  # site -> its push for this round
    pushed_at: dict[str, float] = field(default_factory=dict)  # site -> arrival time
    bytes_up: int = 0
    merged: list[dict[str, Any]] = field(default_factory=list)  # late pushes merged in: site, round, weight, tokens
    sliced: dict[str, list[dict[str, int]]] = field(default_factory=dict)  # what sharded sites' parts held
    evicted: list[str] = field(default_factory=list)  # sites whose lease ended while the round was open
    refused: list[dict[str, Any]] = field(default_factory=list)  # pushes judged and not counted (robust.*): site, round, figures
    clipped: list[dict[str, Any]] = field(default_factory=list)  # pushes counted scaled down (robust.action=clip)
    withheld: list[dict[str, Any]] = field(default_factory=list)  # sites that said they have no Δ: site, round, why
    names: tuple[str, ...] = ()  # the parameters this round syncs: all of them, or one fragment's
    fragment: int = 0
    zero_withheld: bool = False  # quorum.withheld=zero: a withheld site weighs in as a zero Δ

    @staticmethod
    def open(
        number: int, opened_at: float, shapes: Mapping[str, torch.Size], aggregate: str, trim: float = 0.25, fragment: int = 0, withheld: str = "skip"
    ) -> RoundState:
        """``shapes``: the parameters the round syncs (with fragments, fragment ``fragment``'s);
        ``aggregate``, ``trim``: the run's average (diloco.outer.make_aggregate); ``withheld``: quorum.withheld."""
        acc = make_aggregate(shapes, aggregate, trim)
        return RoundState(number=number, opened_at=opened_at, acc=acc, names=tuple(sorted(shapes)), fragment=fragment, zero_withheld=withheld == "zero")

    def take(
        self, header: PushHeader, delta: Mapping[str, torch.Tensor], now: float, sliced: list[dict[str, int]] | None, judged: NormVerdict | None = None
    ) -> None:
        """A push for this round, weighted by its tokens; as ``judged`` says (robust.*): counted,
        counted scaled down (``delta`` is scaled in place), or not counted. A push that was not
        counted still took part: the round does not wait for that site again."""
        self._count(header, delta, float(header.tokens), judged)
        self.pushes[header.site_id] = header
        self.pushed_at[header.site_id] = now
        if sliced is not None:
            self.sliced[header.site_id] = sliced

    def merge(self, header: PushHeader, delta: Mapping[str, torch.Tensor], factor: float, judged: NormVerdict | None = None) -> None:
        """A late push for an earlier round, weighted by its tokens × ``factor``."""
        if self._count(header, delta, float(header.tokens) * factor, judged):
            self.merged.append({"site": header.site_id, "round": header.round, "weight": factor, "tokens": header.tokens})

    def withhold(self, header: PushHeader, now: float) -> None:
        """A site that has no Δ for this round (``header.withheld`` says why): it took part,
        so the round does not wait for it again, and nothing of it is counted."""
        self.pushes[header.site_id] = header
        self.pushed_at[header.site_id] = now
        self.withheld.append({"site": header.site_id, "round": header.round, "why": header.withheld})
        if self.zero_withheld and isinstance(self.acc, WeightedMean):
            self.acc.add_zero(float(header.tokens))

    def counted(self, site_id: str) -> bool:
        """The site's push for this round is in the average (not refused, not withheld)."""
        return site_id in self.pushes and not any(r["site"] == site_id and r["round"] == self.number for r in (*self.refused, *self.withheld))

    def _count(self, header: PushHeader, delta: Mapping[str, torch.Tensor], weight: float, judged: NormVerdict | None) -> bool:
        """Adds ``delta`` to the average as ``judged`` says; False when it was refused."""
        what = {"site": header.site_id, "round": header.round}
        if judged is not None and judged.action == "reject":
            self.refused.append({**what, "norm": judged.norm, "reference": judged.reference, "why": judged.describe()})
            return False
        if judged is not None and judged.action == "clip":
            for t in delta.values():
                t.mul_(judged.scale)
            self.clipped.append({**what, "norm": judged.norm, "reference": judged.reference, "scale": judged.scale, "why": judged.describe()})
        self.acc.add(delta, weight)
        return True
