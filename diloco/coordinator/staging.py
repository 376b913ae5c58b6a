"""The staging buffers pushes are decoded into: a fixed number, so the coordinator's memory is
O(params × buffers) whatever the number of sites, one per site at a time, taken with a timeout.
Thread-safe."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from diloco.errors import CoordinatorError

Buffer = dict[str, torch.Tensor]


class StagingPool:
    def __init__(self, buffers: int, timeout_s: float) -> None:
        self._free: queue.Queue[Buffer] = queue.Queue()
        for _ in range(buffers):
            self._free.put({})
        self._buffers = buffers
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._holders: set[str] = set()

    @contextmanager
    def take(self, site_id: str) -> Iterator[Buffer]:
        """A buffer for one push of ``site_id``, given back on every path. Refused
        (resource_exhausted, which sites retry) when the site holds one already or none comes
        free within the timeout."""
        with self._lock:
            if site_id in self._holders:
                raise CoordinatorError("resource_exhausted", f"site {site_id!r} has a push being decoded already; push again once it is answered")
            self._holders.add(site_id)
        try:
            try:
                buffer = self._free.get(timeout=self._timeout_s)
            except queue.Empty:
                raise CoordinatorError(
                    "resource_exhausted", f"every staging buffer ({self._buffers}) stayed busy for {self._timeout_s:g} s; push again shortly"
                ) from None
            try:
                yield buffer
            finally:
                self._free.put(buffer)
        finally:
            with self._lock:
                self._holders.discard(site_id)
