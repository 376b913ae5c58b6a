"""What the gRPC server needs from the coordinator it serves: a structural type that
``diloco.coordinator.Coordinator`` implements, so the transport depends on no coordinator code.
Each method raises ``diloco.errors.CoordinatorError`` to refuse a call."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

from diloco.boxes import Box
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, PushResult, RoundStatus, SiteEval


class CoordinatorService(Protocol):
    def join(self, request: JoinRequest) -> JoinInfo: ...

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult: ...

    def upload_init(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult: ...

    def wait_round(self, site_id: str, round: int, timeout_s: float, gave_up: threading.Event | None = None) -> RoundStatus: ...

    def pull_update(
        self, site_id: str, round: int, want: Mapping[str, Box] | None = None, wait_s: float = 0.0, gave_up: threading.Event | None = None
    ) -> list[Chunk] | None: ...

    def pull_global(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk]]: ...

    def pull_global_with_state(self, site_id: str, want: Mapping[str, Box] | None = None) -> tuple[RoundStatus, list[Chunk], list[Chunk]]: ...

    def heartbeat(self, site_id: str) -> RoundStatus: ...

    def leave(self, site_id: str, global_sha256: str, eval: SiteEval | None = None) -> None: ...
