"""Evaluation by the sites: each site's held-out loss of θ after a round, checked, kept for a
few rounds and averaged by tokens for that round's metrics line. Not thread-safe on its own:
the coordinator calls it under its lock."""

from __future__ import annotations

import math
from typing import Any

from diloco.types import SiteEval


class SiteEvals:
    def __init__(self) -> None:
        self._by_round: dict[int, dict[str, SiteEval]] = {}  # round -> site -> its evaluation of θ after it

    @staticmethod
    def problem(site_id: str, e: SiteEval, committed: int) -> str | None:
        """Why an evaluation cannot be taken: it must be of a committed round, finite, over a
        sane token count; None if it can."""
        if not 0 <= e.round < committed:
            return f"site {site_id!r} reports eval_round={e.round}; committed rounds are 0..{committed - 1}"
        if not (math.isfinite(e.loss) and e.loss >= 0):
            return f"site {site_id!r} reports eval_loss={e.loss}; must be a finite number >= 0"
        if not 0 < e.tokens < 2**53:
            return f"site {site_id!r} reports eval_tokens={e.tokens}; must be in 1..2^53"
        return None

    def add(self, site_id: str, e: SiteEval) -> None:
        self._by_round.setdefault(e.round, {})[site_id] = e

    def prune(self, before: int) -> None:
        for old in [r for r in self._by_round if r < before]:
            del self._by_round[old]

    def mean(self, round: int) -> dict[str, Any] | None:
        """Token-weighted mean loss (nats per token), tokens and the reporting sites of
        ``round``; None if no site reported one."""
        evals = self._by_round.get(round, {})
        if not evals:
            return None
        tokens = sum(e.tokens for e in evals.values())
        loss = sum(e.loss * e.tokens for e in evals.values()) / tokens
        return {"loss": loss, "tokens": tokens, "sites": sorted(evals)}
