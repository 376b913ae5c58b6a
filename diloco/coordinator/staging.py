"""The staging buffers pushes are decoded into: a fixed number, so the coordinator's memory is
O(params × buffers) whatever the number of sites, one per site at a time, taken with a timeout.
Thread-safe.

A push that stalls cannot hold a buffer another push needs. Each buffer is held through a
``Lease``: its holder owns the buffer (decodes into it) at all times except while it waits for
its next chunk (``Lease.idle``). A push that needs a buffer while none is free takes the one
whose holder has waited longest, once that wait has lasted ``stall_s``; the holder learns it
when its wait ends (its next chunk arrives, or its stream ends) and its push is refused with
resource_exhausted, which sites retry: a live site pushes again from the start, and nothing of
the refused push was counted.

Why this rather than a shorter stream-idle cut or a time limit per push: a slow but steady push
(a thin link) is never evicted, however long it takes, since each chunk is progress; a stalled
push loses its buffer only when another push waits for one, so a lone site whose link pauses
loses nothing; and the evicting push never waits for the stalled one (whose thread is blocked
reading its stream): eviction is a non-blocking try of the lease's lock, which a holder that is
decoding holds, so a holder making progress is never evicted and nothing can wedge on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from diloco.errors import CoordinatorError

Buffer = dict[str, torch.Tensor]


class Lease:
    """One push's hold on a staging buffer. Its holder owns ``buffer`` except inside ``idle()``;
    only then may the pool give the buffer to another push."""

    def __init__(self, buffer: Buffer, site_id: str, clock: Callable[[], float]) -> None:
        self.buffer = buffer
        self.site_id = site_id
        self._clock = clock
        self._owned = threading.Lock()  # held by the holder, except while it is idle
        self._owned.acquire()
        self._idle_since: float | None = None
        self._lost: str | None = None  # why the buffer went to another push

    @contextmanager
    def idle(self) -> Iterator[None]:
        """The holder waits for input (its next chunk) and touches no buffer meanwhile. If the
        buffer went to another push during the wait, leaving raises resource_exhausted, and the
        holder must not write into ``buffer`` again."""
        self._idle_since = self._clock()
        self._owned.release()
        try:
            yield
        finally:
            self._owned.acquire()
            self._idle_since = None
        if self._lost is not None:
            raise CoordinatorError("resource_exhausted", self._lost)

    def stalled_for(self, now: float) -> float | None:
        """How long the holder has been waiting for input (None: it is not waiting)."""
        since = self._idle_since
        return None if since is None else now - since

    def surrender(self, now: float, stall_s: float) -> bool:
        """Marks the buffer lost if its holder has waited for input at least ``stall_s``. Never
        blocks: a holder that is decoding holds the lease's lock and is not evicted."""
        if not self._owned.acquire(blocking=False):
            return False
        try:
            stalled = self.stalled_for(now)
            if stalled is None or stalled < stall_s:
                return False
            self._lost = (
                f"push of site {self.site_id!r} refused: it sent no chunk for {stalled:.1f} s while other pushes waited for a staging "
                f"buffer (staging_stall_s={stall_s:g}); its buffer was given to another push and nothing of this push was counted; push again"
            )
            return True
        finally:
            self._owned.release()


class StagingPool:
    def __init__(self, buffers: int, timeout_s: float, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``timeout_s``: how long a push waits for a buffer; ``stall_s``: how long a holder
        may wait for input before a waiting push may take its buffer."""
        self._free: list[Buffer] = [{} for _ in range(buffers)]
        self._held: list[Lease] = []
        self._buffers = buffers
        self._timeout_s = timeout_s
        self._stall_s = stall_s
        self._clock = clock
        self._cv = threading.Condition()
        self._holders: set[str] = set()

    @property
    def free(self) -> int:
        """How many buffers no push holds."""
        with self._cv:
            return len(self._free)

    @contextmanager
    def take(self, site_id: str) -> Iterator[Lease]:
        """A lease on a buffer for one push of ``site_id``, the buffer given back on every path
        (unless it went to another push). Refused (resource_exhausted, which sites retry) when
        the site holds one already or none comes free within the timeout."""
        with self._cv:
            if site_id in self._holders:
                raise CoordinatorError("resource_exhausted", f"site {site_id!r} has a push being decoded already; push again once it is answered")
            self._holders.add(site_id)
        try:
            lease = self._lease(site_id)
            try:
                yield lease
            finally:
                self._give_back(lease)
        finally:
            with self._cv:
                self._holders.discard(site_id)

    def _lease(self, site_id: str) -> Lease:
        with self._cv:
            deadline = self._clock() + self._timeout_s
            while True:
                now = self._clock()
                buffer = self._free.pop() if self._free else self._evict(now)
                if buffer is not None:
                    lease = Lease(buffer, site_id, self._clock)
                    self._held.append(lease)
                    return lease
                if now >= deadline:
                    raise CoordinatorError(
                        "resource_exhausted",
                        f"every staging buffer ({self._buffers}) stayed busy with pushes that made progress for {self._timeout_s:g} s; push again shortly",
                    )
                self._cv.wait(min(deadline - now, self._recheck_in(now)))

    def _evict(self, now: float) -> Buffer | None:
        """Under the lock: the buffer of the holder that has waited longest for input, if that
        wait has lasted ``stall_s``; that holder's lease is lost."""
        idle = [(stalled, lease) for lease in self._held if (stalled := lease.stalled_for(now)) is not None]
        for _stalled, lease in sorted(idle, key=lambda pair: -pair[0]):
            if lease.surrender(now, self._stall_s):
                self._held.remove(lease)
                return lease.buffer
        return None

    def _recheck_in(self, now: float) -> float:
        """Under the lock: when a holder may next have stalled long enough; at most ``stall_s``
        (a holder decoding now may go idle meanwhile)."""
        waits = [self._stall_s - stalled for lease in self._held if (stalled := lease.stalled_for(now)) is not None and stalled < self._stall_s]
        return min([self._stall_s, *waits])

    def _give_back(self, lease: Lease) -> None:
        with self._cv:
            if lease in self._held:  # not lost to another push
                self._held.remove(lease)
                self._free.append(lease.buffer)
                self._cv.notify_all()
