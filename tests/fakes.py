"""Test doubles shared by several test files."""


class FakeClock:
    """A monotonic clock that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
