"""What the observers read of the things they watch: structural types that the coordinator
(diloco.coordinator.Coordinator), a site's outer sync (diloco.site.outer_sync.OuterSync) and its
round loop (diloco.site.loop.RoundLoop) implement. This package sits below them and only reads
them; the protocols say exactly what it reads, and tests/unit/test_watched.py checks that the
real classes have it, so renaming one breaks a test rather than a dashboard."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CommitRecord(Protocol):
    """A committed round's record (diloco.coordinator.commit.RoundRecord), as the metrics count it."""

    round: int
    tokens: int
    wall_s: float
    rejected: bool
    refused: Sequence[Mapping[str, Any]]
    withheld: Sequence[Mapping[str, Any]]


class CoordinatorSetup(Protocol):
    """The coordinator's config, as far as an observer needs it."""

    @property
    def total_rounds(self) -> int: ...

    @property
    def checkpoint_dir(self) -> str | None: ...


@runtime_checkable
class WatchedCoordinator(Protocol):
    cfg: CoordinatorSetup
    run_id: str
    on_commit: list[Callable[[CommitRecord], None]]

    @property
    def committed_rounds(self) -> int: ...

    @property
    def finished(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    @property
    def failed(self) -> str | None: ...

    @property
    def init_from(self) -> str: ...

    def global_sha256(self) -> str: ...

    def site_counts(self) -> dict[str, int]: ...

    def site_states(self) -> dict[str, dict[str, Any]]: ...

    def recent_records(self) -> dict[int, dict[str, Any]]: ...

    def commit_timings(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class SyncCounts(Protocol):
    """A site's outer-sync counters (diloco.site.stats.SyncStats)."""

    reconnects: int
    rejoins: int
    dropped_rounds: list[int]
    bytes_up: int
    bytes_down: int


@runtime_checkable
class WatchedSync(Protocol):
    stats: SyncCounts


@runtime_checkable
class LoopCounts(Protocol):
    """A site's round loop's counters (diloco.site.loop.LoopStats)."""

    stall_s: float
    stalls: int
    started: float


@runtime_checkable
class WatchedLoop(Protocol):
    stats: LoopCounts
