"""Errors the coordinator reports to a caller; the transport maps ``code`` to a gRPC status."""

from __future__ import annotations

from typing import Literal

# aborted: the round closed without this site's push; it should pull θ and go on.
# unavailable: not now (θ₀ is being uploaded by another site); the caller retries with backoff.
ErrorCode = Literal["invalid_argument", "failed_precondition", "not_found", "unauthenticated", "out_of_range", "aborted", "unavailable"]


class CoordinatorError(Exception):
    """A request was refused. Nothing in the coordinator's state changed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
