"""init=site: which joining site sends θ₀ when the coordinator starts without a model.

At most one site is the source at a time. It keeps the role while its upload is under way;
a source that fails its upload, or does not start it within ``timeout_s`` of being chosen (it
crashed, or lost its connection), loses the role and the next site that can upload takes it.
Not thread-safe on its own: the coordinator calls it under its lock. The clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from diloco.types import TensorSpec


class InitElection:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.timeout_s = timeout_s
        self._clock = clock
        self.source: str | None = None  # the site chosen to upload θ₀
        self.specs: dict[str, TensorSpec] = {}  # the fingerprint it declared when it joined
        self.uploading = False
        self._chosen_at = 0.0
        self.refused: list[str] = []  # why earlier sources' uploads were refused (for the log)

    def free(self) -> bool:
        """No site holds the role (nobody was chosen, or the last source gave it up or timed out)."""
        if self.source is not None and not self.uploading and self._clock() - self._chosen_at > self.timeout_s:
            self.source = None
        return self.source is None

    def choose(self, site_id: str, specs: dict[str, TensorSpec]) -> bool:
        """Makes ``site_id`` the source if the role is free (or already its: a repeated Join)."""
        if self.source == site_id and not self.uploading:
            self._chosen_at = self._clock()
            self.specs = specs
            return True
        if not self.free():
            return False
        self.source, self.specs, self.uploading, self._chosen_at = site_id, specs, False, self._clock()
        return True

    def start(self, site_id: str) -> str | None:
        """The source begins its upload; the reason it may not, or None."""
        if self.source != site_id:
            held = f"site {self.source!r} was chosen" if self.source is not None else "no site was chosen (join first)"
            return f"site {site_id!r} is not the source of θ₀: {held}"
        if self.uploading:
            return f"site {site_id!r} is already uploading θ₀"
        self.uploading = True
        return None

    def release(self, site_id: str, why: str) -> None:
        """The source's upload failed: the role goes to the next site that can upload."""
        if self.source == site_id:
            self.source, self.specs, self.uploading = None, {}, False
            self.refused.append(why)
