"""The ``sync`` section: when and how a site exchanges with the coordinator.

Four ways to sync, all over the same coordinator rounds (docs/streaming.md):

* blocking DiLoCo (the default): every ``every`` = H steps a site pushes Δ, waits for the
  round and loads θ;
* streaming (``fragments`` F > 1 and/or ``overlap`` τ > 0, arXiv 2501.18512): a round every
  H/F steps, each syncing one fragment of the parameters; the site trains τ more steps while
  the round is in flight, then merges the landed fragment (``merge``);
* ``mode=delayed`` / ``mode=eager`` (arXiv 2502.12996): the whole sync overlaps the next
  inner phase, which starts from θ as known (delayed: one round old) or from θ moved by
  the outer step's look-ahead with the site's own fresh Δ (eager).

One name per concept: ``merge`` says how a landed fragment meets the local one
(``mix``: ``local_weight``·local + (1 − local_weight)·θ, of which ``local_weight = 0`` is a
plain replace; ``delta``; ``ahead``), ``mode`` where each inner phase starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from diloco.fields import choice, fraction, integer, setting
from diloco.outer.eager import AHEAD_WEIGHT, EAGER_WEIGHT


class SyncMode(enum.StrEnum):
    """Where each inner phase starts, and whether the site waits for its round."""

    BLOCKING = "blocking"  # from θ after the round: the site waits for it (streaming overlaps τ steps at most)
    EAGER = "eager"  # from θ plus the outer step's look-ahead with the site's own Δ; the round lands a phase later
    DELAYED = "delayed"  # from θ as known when pushing (one round old); the round lands a phase later


class Merge(enum.StrEnum):
    """How a landed fragment meets the local one (streaming)."""

    MIX = "mix"  # local_weight·local + (1 − local_weight)·θ (0: replace)
    DELTA = "delta"  # θ + the local steps trained since the push: none lost, none counted twice
    AHEAD = "ahead"  # delta, those steps taken from a look-ahead of the outer step in flight


class FragmentSplit(enum.StrEnum):
    STRIDED = "strided"  # whole layers: layer i in fragment i mod F (Streaming DiLoCo's)
    BALANCED = "balanced"  # equal sizes: each tensor, largest first, to the smallest fragment


class Preset(enum.StrEnum):
    """A word for a whole choice of the sync keys."""

    NONE = "none"  # the keys as they are written
    HIDE_LINK = "hide_link"  # diloco-plan's model chooses fragments, τ, the merge and the codecs for the run's link (diloco.app.preset)


class FragmentEnd(enum.StrEnum):
    FLUSH = "flush"  # fragments 0..F-2 train to the last step, then F − 1 flush rounds sync them
    FREEZE = "freeze"  # each fragment stops training at its last push: no flush rounds


@dataclass(frozen=True)
class SyncConfig:
    """When and how a site exchanges with the coordinator (conf/run.yaml's ``sync:``)."""

    every: int = setting(50, doc="H: inner steps between two syncs of the same parameters (with fragments, a round every H/F steps)")
    schedule: tuple[int, ...] | None = setting(
        None, doc="the H of the first rounds, ending at `every`, e.g. [10, 25, 50]: frequent syncs early (blocking mode, one fragment only)"
    )
    budget_s: float | None = setting(
        None,
        doc="dynamic local steps: each site trains this many seconds per round (at least 1 step, at most H/F) and weighs in by its tokens; null: exactly H/F steps",
    )
    fragments: int = setting(1, doc="F: streaming fragments of the parameters, one synced per round (`every` divisible by F)")
    split: FragmentSplit = setting(FragmentSplit.STRIDED, doc="how the parameters split into fragments: strided (whole layers) | balanced (equal sizes)")
    end: FragmentEnd = setting(
        FragmentEnd.FLUSH, doc="how a streaming run ends: flush (F − 1 flush rounds after the last step) | freeze (each fragment stops at its last push)"
    )
    overlap: int = setting(0, doc="τ: steps a site trains while a round is in flight, before merging it (below every/fragments)")
    merge: Merge = setting(
        Merge.MIX,
        doc="how a landed fragment meets the local one: mix (local_weight·local + (1 − local_weight)·θ) | delta (θ + the steps trained since the push) | ahead (delta, from a look-ahead of the outer step)",
    )
    local_weight: float | None = setting(None, doc="merge=mix: the local values' weight in [0, 1] (0: replace); null: 0.5 with overlap > 0, else 0")
    mode: SyncMode = setting(
        SyncMode.BLOCKING,
        doc="blocking | eager | delayed: eager and delayed overlap the whole sync with the next inner phase, which starts from θ plus the look-ahead with the own Δ (eager) or from θ one round old (delayed)",
    )
    lookahead_weight: float | None = setting(
        None, doc="mode=eager or merge=ahead: the own Δ's weight in [0, 1] in place of the mean still in flight; null: 0.5 (eager), 0 (ahead)"
    )
    streams: int = setting(1, doc="connection striping: each push and pull over this many concurrent streams (TCP connections); a site's own choice")
    preset: Preset = setting(
        Preset.NONE,
        doc="none | hide_link: diloco-plan's model chooses fragments, overlap, merge and codecs for the link (keys set by hand stay); config.json records the choice",
    )
    link_mbit: float | None = setting(None, doc="preset=hide_link: each site's link, Mbit/s each way; null: diloco-sim's emulated one (wan.*)")
    link_rtt_ms: float | None = setting(None, doc="preset=hide_link: the round-trip time site <-> coordinator, ms; null: diloco-sim's emulated one")
    step_s: float | None = setting(None, doc="preset=hide_link: seconds of one inner step at a site; null: measured on this machine (diloco-sim)")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        integer(self.every, "sync.every", 1)
        integer(self.fragments, "sync.fragments", 1)
        integer(self.overlap, "sync.overlap", 0)
        integer(self.streams, "sync.streams", 1, 64)
        for name, kind in (("split", FragmentSplit), ("end", FragmentEnd), ("merge", Merge), ("mode", SyncMode), ("preset", Preset)):
            set_(self, name, choice(kind, getattr(self, name), f"sync.{name}"))
        if self.budget_s is not None and (isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)) or not self.budget_s > 0):
            raise ValueError(f"sync.budget_s={self.budget_s!r}: must be null or a number of seconds > 0")
        if self.schedule is not None:
            if isinstance(self.schedule, (str, bytes)) or not hasattr(self.schedule, "__iter__"):
                raise ValueError(f"sync.schedule={self.schedule!r}: must be a list of H values, e.g. [10, 25, {self.every}]")
            set_(self, "schedule", tuple(self.schedule))
        fraction(self.lookahead_weight, "sync.lookahead_weight", none="eager 0.5, ahead 0")
        for name in ("link_mbit", "link_rtt_ms", "step_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or (name != "link_rtt_ms" and value == 0)
            ):
                raise ValueError(f"sync.{name}={value!r}: must be null or a number > 0" + (" (>= 0 for the RTT)" if name == "link_rtt_ms" else ""))
        weight = fraction(self.local_weight, "sync.local_weight", none="0.5 with overlap, else 0")
        set_(self, "local_weight", (0.5 if self.overlap > 0 else 0.0) if weight is None else weight)
        why = self._combination_problem()
        if why is not None:
            raise ValueError(why)

    def _combination_problem(self) -> str | None:
        """Fields that are fine alone but cannot work together."""
        if self.every % self.fragments:
            return f"sync.every={self.every} is not divisible by sync.fragments={self.fragments}: a fragment syncs every H/F steps"
        if self.overlap >= self.round_steps:
            return f"sync.overlap={self.overlap}: must be below sync.every/sync.fragments = {self.round_steps} (one round in flight at a time)"
        if self.mode != SyncMode.BLOCKING and (self.fragments > 1 or self.overlap > 0):
            return (
                f"sync.mode={self.mode} overlaps the whole sync with the next inner phase; it cannot be combined with "
                f"sync.fragments={self.fragments} or sync.overlap={self.overlap} (use sync.mode=blocking for streaming)"
            )
        if self.end == FragmentEnd.FREEZE and self.fragments == 1:
            return "sync.end=freeze stops each fragment at its last push: it needs sync.fragments > 1 (this run has 1)"
        if self.merge == Merge.AHEAD and self.mode != SyncMode.BLOCKING:
            return f"sync.merge=ahead looks ahead of a fragment's round while τ steps overlap it; sync.mode={self.mode} starts whole phases from its own point: use sync.merge=delta"
        if self.lookahead_weight is not None and not self.looks_ahead:
            return f"sync.lookahead_weight={self.lookahead_weight}: only for sync.mode=eager or sync.merge=ahead (this run has mode={self.mode}, merge={self.merge})"
        return self._schedule_problem()

    def _schedule_problem(self) -> str | None:
        early = list(self.schedule or ())
        if not early:
            return None
        if any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in early):
            return f"sync.schedule={early}: every entry must be an integer >= 1 (inner steps of a round)"
        if early[-1] != self.every:
            return f"sync.schedule={early}: must end at sync.every={self.every} (the H the run goes on with)"
        if self.fragments > 1 or self.overlap > 0 or self.mode != SyncMode.BLOCKING:
            return (
                f"sync.schedule cannot be combined with sync.fragments={self.fragments}, sync.overlap={self.overlap} or "
                f"sync.mode={self.mode}: it is for blocking DiLoCo (fragments=1, overlap=0, mode=blocking)"
            )
        return None

    @property
    def round_steps(self) -> int:
        """Inner steps between two pushes (a coordinator round): H/F."""
        return self.every // self.fragments

    @property
    def looks_ahead(self) -> bool:
        """The site follows the outer step in flight (mode=eager or merge=ahead): it needs the run's outer step."""
        return self.mode == SyncMode.EAGER or self.merge == Merge.AHEAD

    @property
    def own_weight(self) -> float:
        """The own Δ's weight in a look-ahead: lookahead_weight, or its mode's default."""
        if self.lookahead_weight is not None:
            return float(self.lookahead_weight)
        return EAGER_WEIGHT if self.mode == SyncMode.EAGER else AHEAD_WEIGHT

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap > 0
