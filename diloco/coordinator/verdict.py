"""What to do with a push, from the round it is for and what the coordinator has seen: a
pure function, so every case is tested without a coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.coordinator.round_policy import QuorumConfig

Verdict = Literal["take", "merge", "duplicate", "late", "not_open", "past_end"]


@dataclass(frozen=True)
class PushFacts:
    round: int  # the round the push is for
    open_round: int
    total_rounds: int
    pushed_this_round: bool  # this site's push for the open round is in already
    counted_before: bool  # the push for this (earlier) round counted already: in it, or merged


def push_verdict(f: PushFacts, quorum: QuorumConfig) -> Verdict:
    """``take`` (for the open round), ``merge`` (late, folded into the open round: quorum.late
    = merge, at most max_staleness rounds late), ``duplicate`` (a harmless repeat), or why it
    cannot be taken: ``late`` (its round was committed without it), ``not_open`` (a future
    round) or ``past_end`` (after the run's last round)."""
    if f.round >= f.total_rounds:
        return "past_end"
    if f.round > f.open_round:
        return "not_open"
    if f.round == f.open_round:
        return "duplicate" if f.pushed_this_round else "take"
    if f.counted_before:
        return "duplicate"
    mergeable = f.open_round < f.total_rounds and f.open_round - f.round <= quorum.max_staleness
    return "merge" if quorum.late == "merge" and mergeable else "late"
