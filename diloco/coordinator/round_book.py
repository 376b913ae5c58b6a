"""The control plane's book of rounds: which round is open and in which phase, who it counts so
far (its ``RoundState``), who each committed round counted, the recent rounds' records and
commit timings, and the pushes that came too late. No tensors: the data plane
(diloco.coordinator.shard) holds what the pushes sum to.

A round's phase is one enum. OPEN: it takes pushes. CLOSING: its commit is computed (θ has
moved) and it takes nothing more. SERVING: its update is with the downlink (held pulls stream
it) while its checkpoint is written. Publishing it opens the next round. Takes no lock: the
coordinator holds its lock around every call.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping
from typing import Any

from diloco.coordinator.commit import RoundRecord
from diloco.coordinator.round_state import RoundState

KEEP_RECORDS = 16
KEEP_TIMINGS = 4096  # commit_timings: the last rounds' (a few hundred bytes each)


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    SERVING = "serving"


class RoundBook:
    def __init__(self, total_rounds: int, started: float, withheld: str = "skip") -> None:
        self.total_rounds = total_rounds
        self.withheld = withheld  # quorum.withheld, for each round's state
        self.open = 0  # the open round = the number of committed (published) rounds
        self.phase = Phase.OPEN
        self.started = started  # the coordinator's clock at its start (a record's elapsed_s)
        self.current = RoundState.open(0, started, withheld=withheld)
        self.participants: dict[int, list[str]] = {}  # committed round -> the sites it counted
        self.records: dict[int, dict[str, Any]] = {}  # the last few rounds' RoundRecord.summary()
        self.merged_done: set[tuple[str, int]] = set()  # (site, round) of every merged push (repeats are duplicates)
        # open round -> pushes refused while it was open, for rounds already closed without them
        self.late: dict[int, list[dict[str, str | int]]] = {}
        # The seconds of each recent commit's parts (commit_timings): what the closing push costs.
        self.timings: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_TIMINGS)

    @property
    def finished(self) -> bool:
        return self.open >= self.total_rounds

    def reopen(self, number: int, opened_at: float, names: tuple[str, ...], fragment: int) -> None:
        """Round ``number`` is open from ``opened_at``, syncing ``names`` (fragment ``fragment``)."""
        self.current = RoundState.open(number, opened_at, names, fragment, self.withheld)

    # ---- a round's commit ------------------------------------------------------------------
    def closing(self, record: RoundRecord) -> None:
        """The open round's commit is computed: it counted ``record.participants``."""
        r = record.round
        self.participants[r] = record.participants
        self.records[r] = record.summary()
        for old in [k for k in self.records if k <= r - KEEP_RECORDS]:
            del self.records[old]
        self.phase = Phase.CLOSING

    def serving(self) -> None:
        """Its update is with the downlink; its checkpoint is being written."""
        self.phase = Phase.SERVING

    def published(self, round: int, times: dict[str, Any]) -> None:
        """Round ``round`` is durable and published: the next one is open (``reopen`` it)."""
        self.open = round + 1
        self.phase = Phase.OPEN
        self.timings.append(times)

    def servable(self, round: int, early: bool = False) -> bool:
        """Round ``round``'s update may be pulled: it is published, or (``early``) it is being
        made durable while its update is already with the downlink."""
        return round < self.open or (early and self.phase == Phase.SERVING and round == self.open)

    # ---- what became of pushes ---------------------------------------------------------------
    def counted_before(self, site: str, round: int) -> bool:
        """The site's push for ``round`` was counted already (committed, or merged late)."""
        return site in self.participants.get(round, ()) or (site, round) in self.merged_done

    def note_late(self, site: str, round: int) -> None:
        """A push for ``round`` came after it closed without the site."""
        late = self.late.setdefault(self.open, [])
        if {"site": site, "round": round} not in late:
            late.append({"site": site, "round": round})

    def late_pushes(self, round: int) -> list[dict[str, Any]]:
        """Pushes that arrived while ``round`` was open, for rounds committed without them; for
        the last round, also those that arrived after it was committed."""
        last = round + 1 >= self.total_rounds
        return [p for r in sorted(self.late) if r == round or (last and r > round) for p in self.late[r]]

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, committed: int) -> dict[str, Any]:
        return {
            "committed_rounds": committed,
            "participants": {str(r): list(p) for r, p in self.participants.items()},
            "records": {str(r): rec for r, rec in self.records.items()},
            "merged_done": sorted(self.merged_done),
        }

    def restore(self, state: Mapping[str, Any], now: float) -> None:
        """The book of a checkpoint: ``now`` the coordinator's clock as it resumes (elapsed_s goes
        on from where the predecessor stopped)."""
        committed = int(state["committed_rounds"])
        self.open = committed
        self.phase = Phase.OPEN
        self.participants = {int(r): list(p) for r, p in state["participants"].items()}
        self.records = {int(r): dict(rec) for r, rec in state.get("records", {}).items()}
        self.merged_done = {(str(s), int(r)) for s, r in state.get("merged_done", [])}
        last = self.records.get(committed - 1)
        if last is not None:
            self.started = now - float(last["elapsed_s"])
