"""A run's rounds in inner steps: which round trains how many steps, and where a round starts
in the lr schedule and the data. Derived from the ``sync`` section and the run's length; the
site's loop (diloco.site.loop) and the progress views follow it."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.sync.config import FragmentEnd, SyncConfig, SyncMode


@dataclass(frozen=True)
class SyncSchedule:
    sync: SyncConfig
    # Rounds with inner steps (R × F); with fragments, the F − 1 rounds after them are flush
    # rounds with none: fragments 0 .. F−2 push what they trained since their last sync, so
    # the run's θ holds every step. None: every round trains (an open-ended loop).
    train_rounds: int | None = None

    @staticmethod
    def of(sync: SyncConfig, rounds: int) -> SyncSchedule:
        """The schedule of a run of ``rounds`` rounds of H steps."""
        return SyncSchedule(sync, train_rounds=rounds * sync.fragments)

    @property
    def fragments(self) -> int:
        return self.sync.fragments

    @property
    def early(self) -> tuple[int, ...]:
        """The H of the first rounds (sync.schedule), growing to H."""
        return tuple(self.sync.schedule or ())

    @property
    def round_steps(self) -> int:
        """Inner steps between two pushes (a coordinator round): H/F."""
        return self.sync.round_steps

    def steps_of(self, round: int) -> int:
        """Inner steps before round ``round``'s push: H/F (the schedule's H in its first
        rounds), or 0 for a flush round."""
        if round < len(self.early):
            return self.early[round]
        return self.round_steps if self.train_rounds is None or round < self.train_rounds else 0

    def flushes(self, round: int) -> bool:
        """Round ``round`` is a flush round (no inner steps before its push)."""
        return self.train_rounds is not None and round >= self.train_rounds

    def steps_before(self, round: int) -> int:
        """Inner steps of rounds 0 .. ``round`` − 1: where round ``round`` starts in the lr
        schedule and the data."""
        early = self.early
        n = min(round, len(early))
        trained = round if self.train_rounds is None else min(round, self.train_rounds)
        return sum(early[:n]) + max(0, trained - n) * self.round_steps

    def total_rounds(self, rounds: int) -> int:
        """The coordinator's rounds for ``rounds`` rounds of H steps: R × F, plus F − 1 flush
        rounds unless the fragments freeze."""
        f = self.sync.fragments
        return rounds * f + (0 if self.sync.end == FragmentEnd.FREEZE else f - 1)

    def frozen_after(self, round: int) -> bool:
        """Under ``end=freeze``, round ``round`` is its fragment's last: the fragment stops
        training once it is pushed."""
        f = self.sync.fragments
        return self.sync.end == FragmentEnd.FREEZE and self.train_rounds is not None and self.train_rounds - f <= round < self.train_rounds

    @property
    def overlapped(self) -> bool:
        """The site pushes without waiting for the round."""
        return self.sync.overlap > 0 or self.sync.mode != SyncMode.BLOCKING

    @property
    def label(self) -> str:
        """blocking | streaming | eager | delayed: how this run syncs, in a word."""
        if self.sync.mode != SyncMode.BLOCKING:
            return str(self.sync.mode)
        return "streaming" if self.sync.streaming else "blocking"

    @property
    def land_after(self) -> int | None:
        """Steps after a push at which its round is merged (streaming: τ); None: at the end of
        the next inner phase, before its push (delayed, eager)."""
        return self.sync.overlap if self.sync.mode == SyncMode.BLOCKING else None

    @property
    def total_steps(self) -> int | None:
        """Inner steps per site over the run (None for an open-ended loop)."""
        return None if self.train_rounds is None else self.steps_before(self.train_rounds)
