"""The open round's facts: who pushed into it, when, and what became of each push (taken,
merged late, refused, clipped, withheld). A fresh ``RoundState`` opens every round
(``RoundState.open``), so nothing of a round outlives it by accident.

This is the control plane's view of a round: which sites it counts, with which weight. The
sum of their pseudo-gradients is the data plane's (diloco.coordinator.shard): each method
here that counts a push returns the weight to add it with, or None when it is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.outer import NormVerdict
from diloco.types import PushHeader


@dataclass
class RoundState:
    number: int
    opened_at: float  # the coordinator's clock when the round opened (previous commit or start)
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
    def open(number: int, opened_at: float, names: tuple[str, ...] = (), fragment: int = 0, withheld: str = "skip") -> RoundState:
        """``names``: the parameters the round syncs (with fragments, fragment ``fragment``'s);
        ``withheld``: quorum.withheld."""
        return RoundState(number=number, opened_at=opened_at, names=tuple(sorted(names)), fragment=fragment, zero_withheld=withheld == "zero")

    def take(self, header: PushHeader, now: float, sliced: list[dict[str, int]] | None, judged: NormVerdict | None = None) -> float | None:
        """A push for this round: its weight (its tokens) as ``judged`` says (robust.*), or None
        when it is not counted. A push that was not counted still took part: the round does
        not wait for that site again."""
        weight = self._judged(header, float(header.tokens), judged)
        self.pushes[header.site_id] = header
        self.pushed_at[header.site_id] = now
        if sliced is not None:
            self.sliced[header.site_id] = sliced
        return weight

    def merge(self, header: PushHeader, factor: float, judged: NormVerdict | None = None) -> float | None:
        """A late push for an earlier round: its weight, its tokens × ``factor`` (or None)."""
        weight = self._judged(header, float(header.tokens) * factor, judged)
        if weight is not None:
            self.merged.append({"site": header.site_id, "round": header.round, "weight": factor, "tokens": header.tokens})
        return weight

    def withhold(self, header: PushHeader, now: float) -> float | None:
        """A site that has no Δ for this round (``header.withheld`` says why): it took part, so
        the round does not wait for it again; returns the weight of a zero Δ under
        quorum.withheld=zero (its tokens), else None (nothing of it is counted)."""
        self.pushes[header.site_id] = header
        self.pushed_at[header.site_id] = now
        self.withheld.append({"site": header.site_id, "round": header.round, "why": header.withheld})
        return float(header.tokens) if self.zero_withheld else None

    def counted(self, site_id: str) -> bool:
        """The site's push for this round is in the average (not refused, not withheld)."""
        return site_id in self.pushes and not any(r["site"] == site_id and r["round"] == self.number for r in (*self.refused, *self.withheld))

    def _judged(self, header: PushHeader, weight: float, judged: NormVerdict | None) -> float | None:
        """``weight``, or None for a push ``judged`` refuses; a clipped one is recorded (the
        caller scales its Δ by ``judged.scale``)."""
        what = {"site": header.site_id, "round": header.round}
        if judged is not None and judged.action == "reject":
            self.refused.append({**what, "norm": judged.norm, "reference": judged.reference, "why": judged.describe()})
            return None
        if judged is not None and judged.action == "clip":
            self.clipped.append({**what, "norm": judged.norm, "reference": judged.reference, "scale": judged.scale, "why": judged.describe()})
        return weight
