"""Every case of the coordinator's push verdict, without a coordinator."""

from __future__ import annotations

import pytest

from diloco.coordinator.round_policy import QuorumConfig
from diloco.coordinator.verdict import PushFacts, push_verdict

DROP, MERGE = QuorumConfig(late="drop"), QuorumConfig(late="merge", max_staleness=2)


@pytest.mark.parametrize(
    ("facts", "quorum", "verdict"),
    [
        (PushFacts(round=3, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), DROP, "take"),
        (PushFacts(round=3, open_round=3, total_rounds=5, pushed_this_round=True, counted_before=False), DROP, "duplicate"),
        (PushFacts(round=4, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), DROP, "not_open"),
        (PushFacts(round=5, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), DROP, "past_end"),
        (PushFacts(round=2, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=True), DROP, "duplicate"),
        (PushFacts(round=2, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), DROP, "late"),
        (PushFacts(round=2, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), MERGE, "merge"),
        (PushFacts(round=1, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), MERGE, "merge"),
        (PushFacts(round=0, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=False), MERGE, "late"),  # 3 rounds late > 2
        (PushFacts(round=2, open_round=3, total_rounds=5, pushed_this_round=False, counted_before=True), MERGE, "duplicate"),
        (
            PushFacts(round=4, open_round=5, total_rounds=5, pushed_this_round=False, counted_before=False),
            MERGE,
            "late",
        ),  # the run is over: nothing to merge into
    ],
)
def test_push_verdict(facts: PushFacts, quorum: QuorumConfig, verdict: str) -> None:
    assert push_verdict(facts, quorum) == verdict
