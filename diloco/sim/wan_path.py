"""The WAN emulator's path for bytes: one link's wire per direction (bandwidth), its hops
(delay, jitter, a window), the sockets at either end (``Side``: read with the time each byte
came, held back past a small read-ahead) and the tasks that carry segments over a hop and
deliver them (diloco.sim.wan runs them per connection)."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco.sim.links import LinkSpec
from diloco.sim.wan_clock import sleep_until

MIN_READ_AHEAD, MAX_READ_AHEAD = 64 * 1024, 4 * 1024 * 1024
UNLIMITED_PIPE = 16 * 1024 * 1024  # what may be in flight on a hop with no bandwidth limit


class Wire:
    """One direction of one link: sends one segment at a time at the link's rate. Every
    connection through the link shares it, so a site's parallel streams compete for its
    bandwidth as they would on a real link."""

    __slots__ = ("bytes_per_s", "next_free")

    def __init__(self, mbit: float | None) -> None:
        self.bytes_per_s = None if mbit is None else mbit * 1e6 / 8
        self.next_free = 0.0

    def transmit(self, ready: float, n: int) -> float:
        """Reserves the wire for ``n`` bytes that were ready at ``ready``; returns when their
        last byte has left."""
        if self.bytes_per_s is None:
            return ready
        self.next_free = max(ready, self.next_free) + n / self.bytes_per_s
        return self.next_free


@dataclass(frozen=True)
class Hop:
    wire: Wire
    delay_s: float
    jitter_s: float
    window: int | None = None  # bytes a connection may have unacknowledged (LinkSpec.window_kb)

    @property
    def shapes(self) -> bool:
        return self.wire.bytes_per_s is not None or self.delay_s > 0 or self.jitter_s > 0

    def pipe_bytes(self, segment: int) -> int:
        """How much may be in flight after this hop: twice what its delay holds at its rate
        (10 ms more for late wake-ups), so that the capacity never limits the rate, yet memory
        and the queue before a slower next hop stay bounded."""
        if self.wire.bytes_per_s is None:
            return UNLIMITED_PIPE
        return int(2 * self.wire.bytes_per_s * (self.delay_s + self.jitter_s + 0.01)) + 4 * segment


def link_hops(spec: LinkSpec, up: Wire, down: Wire) -> tuple[Hop, Hop]:
    delay, jitter = spec.rtt_ms / 2000, spec.jitter_ms / 1000
    window = None if spec.window_kb is None else max(1, int(spec.window_kb * 1024))
    return Hop(up, delay, jitter, window), Hop(down, delay, jitter, window)


class Side(asyncio.Protocol):
    """One socket of a proxied connection. It keeps what it received with the time it came (when
    it was ready to enter the link) and stops reading the socket past a small read-ahead, so
    memory stays bounded and the sender is held back by its socket buffer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, registry: set[Side], on_made: Callable[[Side], None] | None = None) -> None:
        self.loop, self.registry, self.on_made = loop, registry, on_made
        self.read_ahead = MIN_READ_AHEAD  # until the connection knows its segment length
        registry.add(self)  # the emulator's stop() aborts whatever is still open
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.size = 0
        self.eof_at: float | None = None
        self.lost = False
        self.on_lost: Callable[[], None] = lambda: None  # set by the connection that owns this side
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.on_made is not None:
            self.on_made(self)

    def data_received(self, data: bytes) -> None:
        self.chunks.append((self.loop.time(), data))
        self.size += len(data)
        self._readable.set()
        if self.size >= self.read_ahead and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof_at = self.loop.time()
        self._readable.set()
        return True  # keep the socket open for writing: a half-close passes through

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.registry.discard(self)
        if self.eof_at is None:
            self.eof_at = self.loop.time()
        self._readable.set()
        self._writable.set()
        self.on_lost()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def take(self, max_n: int) -> tuple[float, bytes | None]:
        """Up to ``max_n`` received bytes and when the last of them came; (time, None) at EOF."""
        while not self.chunks:
            if self.eof_at is not None:
                return self.eof_at, None
            self._readable.clear()
            await self._readable.wait()
        parts, n, ready = [], 0, 0.0
        while self.chunks and n < max_n:
            ready, data = self.chunks[0]
            if n + len(data) > max_n:
                cut = max_n - n
                self.chunks[0] = (ready, data[cut:])
                data = data[:cut]
            else:
                self.chunks.popleft()
            parts.append(data)
            n += len(data)
        self.size -= n
        if self._paused and self.size < self.read_ahead and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return ready, parts[0] if len(parts) == 1 else b"".join(parts)

    async def send(self, data: bytes) -> bool:
        """Writes and waits while the socket's buffer is full; False if the socket is gone."""
        if self.lost or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        if not self._writable.is_set():
            await self._writable.wait()
        return not self.lost

    def send_eof(self) -> None:
        if not self.lost and self.transport is not None and not self.transport.is_closing() and self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self, abort: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort() if abort else self.transport.close()


class Pipe:
    """Segments between two stages, each with the time it reaches the next one: what is in
    flight on a hop or queued before the next. Bounded in bytes: a full pipe holds back the
    stage that feeds it. One producer, one consumer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: deque[tuple[float, bytes | None]] = deque()
        self.size = 0
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    async def put(self, when: float, data: bytes | None) -> None:
        while self.size >= self.capacity:
            self._writable.clear()
            await self._writable.wait()
        self.items.append((when, data))
        self.size += len(data) if data else 0
        self._readable.set()

    async def get(self, _max_n: int = 0) -> tuple[float, bytes | None]:
        while not self.items:
            self._readable.clear()
            await self._readable.wait()
        when, data = self.items.popleft()
        self.size -= len(data) if data else 0
        if self.size < self.capacity:
            self._writable.set()
        return when, data


Source = Callable[[int], Any]  # awaitable -> (time, bytes | None)


class Window:
    """One connection's window in one direction: the bytes sent and not yet acknowledged, each
    segment acknowledged ``ack_s`` after its last byte left the wire."""

    __slots__ = ("ack_s", "in_flight", "limit", "unacked")

    def __init__(self, limit: int, ack_s: float) -> None:
        self.limit, self.ack_s = limit, ack_s
        self.in_flight = 0
        self.unacked: deque[tuple[float, int]] = deque()

    def open_at(self, ready: float, n: int) -> float:
        """When ``n`` more bytes fit, at the earliest ``ready``. A segment larger than the
        whole window goes once nothing is in flight."""
        while self.unacked and (self.unacked[0][0] <= ready or self.in_flight + n > self.limit):
            acked_at, k = self.unacked.popleft()
            self.in_flight -= k
            ready = max(ready, acked_at)
        return ready

    def sent(self, done: float, n: int) -> None:
        self.unacked.append((done + self.ack_s, n))
        self.in_flight += n


async def carry(source: Source, hop: Hop, out: Pipe, segment: int, rng: random.Random | None, not_before: float, window: Window | None = None) -> None:
    """One hop of one direction: each segment waits until it reaches the hop (and, on the
    first hop, until the connection's window has room), takes its turn on the hop's wire, and
    is handed on with the time it arrives at the far end."""
    loop = asyncio.get_running_loop()
    last_arrival = 0.0
    while True:
        ready, data = await source(segment)
        n = len(data) if data else 0
        ready = max(ready, not_before)
        if window is not None and n:
            ready = window.open_at(ready, n)
        await sleep_until(loop, ready)
        # The wire is reserved from `ready`, not from now: waking up late must not slow the link.
        done = hop.wire.transmit(ready, n)
        if window is not None and n:
            window.sent(done, n)
        await sleep_until(loop, done)  # back-pressure: the next segment is read once this one left
        jitter = rng.uniform(0, hop.jitter_s) if rng is not None else 0.0
        last_arrival = max(done + hop.delay_s + jitter, last_arrival)
        await out.put(last_arrival, data)
        if data is None:
            return


async def deliver(source: Source, dst: Side, segment: int, stats: dict[str, Any], counter: str) -> None:
    loop = asyncio.get_running_loop()
    while True:
        when, data = await source(segment)
        await sleep_until(loop, when)
        if data is None:
            dst.send_eof()
            return
        if not await dst.send(data):
            return
        stats[counter] += len(data)
