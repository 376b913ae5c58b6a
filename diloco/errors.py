"""The project's refusal kinds: what a coordinator says when it refuses a call, and what a
site sees when a call fails. The transport maps them to and from its own status codes; no
other package names a transport code.

Kinds:
* ``invalid_argument``: the request itself is wrong (a bad header, chunk or model);
* ``failed_precondition``: not now, not from this caller (not a member, round not open);
* ``not_found``: what was asked for is gone (an update older than the coordinator keeps);
* ``unauthenticated``: the caller's credentials are missing or wrong;
* ``permission_denied``: the caller may not do this (a site id it holds no credentials for,
  or one this run was not configured with);
* ``resource_exhausted``: the coordinator is busy (too many calls of this site, every
  staging buffer in use, or a push that stalled lost its buffer to another push); retried
  like ``unavailable``;
* ``out_of_range``: past the run's last round;
* ``aborted``: the round closed without this push; pull θ and go on;
* ``unavailable``: try again shortly (the coordinator is unreachable or restarting, or θ₀ is
  still being uploaded); the only kind a caller retries;
* ``round_timeout``: a site waited longer than its round timeout for a commit;
* ``internal``: anything else the far end reported.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal[
    "invalid_argument",
    "failed_precondition",
    "not_found",
    "unauthenticated",
    "permission_denied",
    "resource_exhausted",
    "out_of_range",
    "aborted",
    "unavailable",
    "round_timeout",
    "internal",
]
KINDS: tuple[Kind, ...] = (
    "invalid_argument", "failed_precondition", "not_found", "unauthenticated", "permission_denied", "resource_exhausted", "out_of_range", "aborted", "unavailable", "round_timeout", "internal",
)  # fmt: skip


class CoordinatorError(Exception):
    """The coordinator refused a request. Nothing in the coordinator's state changed."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class RemoteError(Exception):
    """A site's call was refused or could not be made. ``kind`` is one of KINDS; ``message``
    is the coordinator's explanation (or the transport's, when it was unreachable)."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    @property
    def retryable(self) -> bool:
        """The call may succeed if made again later (the coordinator was unreachable or busy)."""
        return self.kind in ("unavailable", "resource_exhausted")
