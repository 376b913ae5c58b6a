"""What a site's outer sync is given and hands back: its own side of the sync
(``SyncOptions``: what it states at Join, how it talks) and a round between ``begin`` and
``finish`` (``PendingRound``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.codec import CodecConfig, best_settings, codec_config
from diloco.outer.defaults import section_of
from diloco.outer.optimizer import OuterConfig
from diloco.site.exchange import Assembler, Timeouts
from diloco.site.outcome import RoundOutcome
from diloco.sync import RunSettings, SyncConfig
from diloco.types import Chunk, PushHeader
from diloco.wire import MAX_CHUNK_BYTES


@dataclass(frozen=True)
class SyncOptions:
    """A site's own side of the sync: what it states at Join, and how it talks."""

    # The settings this site goes by where the coordinator owns none (a library coordinator);
    # None: the defaults (RunSettings.defaults). Where the coordinator hands out the run's,
    # those replace these, all but ``sync.streams``, which stays the site's own.
    own: RunSettings | None = None
    # Keys of ``own`` (dotted; a section's name takes all of it) that this site's configuration
    # set explicitly: stated at Join, refused by a coordinator whose run has other values.
    stated: tuple[str, ...] = ()
    chunk_bytes: int = MAX_CHUNK_BYTES
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def settings(self) -> RunSettings:
        return self.own if self.own is not None else RunSettings.defaults()

    @staticmethod
    def of(
        *,
        codec: CodecConfig | str | None = None,
        error_feedback: bool = True,
        error_feedback_decay: float | None = None,
        outer: OuterConfig | None = None,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        timeouts: Timeouts | None = None,
        **sync: Any,
    ) -> SyncOptions:
        """Options for a library coordinator (which owns no settings): the site's own settings
        are the defaults with these (``sync``: SyncConfig's fields); nothing is stated."""
        base = RunSettings.defaults()
        c = codec_config(codec) if codec is not None else base.codec
        decay = float(best_settings(c.name)["error_feedback_decay"]) if error_feedback_decay is None else float(error_feedback_decay)  # type: ignore[arg-type]
        own = dataclasses.replace(
            base, sync=SyncConfig(**sync), codec=c, codec_down=c, error_feedback=error_feedback, error_feedback_decay=decay,
            outer=section_of(outer) if outer is not None else base.outer,
        )  # fmt: skip
        return SyncOptions(own=own, chunk_bytes=chunk_bytes, timeouts=timeouts or Timeouts())


@dataclass
class PendingRound:
    """A round between ``begin`` and ``finish``: what is pushed, and (after ``exchange``) how
    it went."""

    header: PushHeader
    chunks: list[Chunk]
    residual: dict[str, torch.Tensor] | None  # the uplink error if this push counts
    times: dict[str, float]
    names: tuple[str, ...] = ()  # the parameters this round syncs (its fragment's)
    parts: list[tuple[PushHeader, list[Chunk]]] = field(default_factory=list)  # striped: the push's parts, one per stream
    delta: dict[str, torch.Tensor] | None = None  # the site's own Δ (kept for an eager start point)
    at_push: dict[str, torch.Tensor] | None = None  # merge=delta/ahead: the fragment's local values when it was pushed (ahead: looked ahead)
    outcome: RoundOutcome | None = None
    update: Assembler | None = None
    diverged: bool = False  # Δ was not finite: the push is withheld and the site restarts from θ
