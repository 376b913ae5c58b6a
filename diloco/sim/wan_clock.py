"""The WAN emulator's clock: an event loop whose timers wake within microseconds, sleeps to an
absolute time, and short time slices asked of the kernel, so that a 2 ms round trip is kept
on a machine whose cores are busy training (docs/wan.md: what was measured)."""

from __future__ import annotations

import asyncio
import ctypes
import platform
import select
import selectors
import struct
import sys

WAKE_SLICE_NS = 100_000  # the time slice the emulator's thread asks the kernel for (Linux 6.12+)
_SCHED_ATTR_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr


class PreciseEpollSelector(selectors.EpollSelector if hasattr(selectors, "EpollSelector") else selectors.DefaultSelector):  # type: ignore[misc]
    """epoll waits in whole milliseconds (Python rounds a timeout up), which makes every timer
    up to 1 ms late (0.8 ms median here): too coarse for a 2 ms RTT accuracy. select() waits in
    microseconds, and the epoll descriptor itself is readable when an event is ready, so the
    wait goes through select() on it and the events are then collected without waiting."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        fd = self._selector.fileno()  # type: ignore[attr-defined]
        if timeout is not None and timeout > 0 and fd < 1024:  # FD_SETSIZE
            select.select([fd], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def new_loop() -> asyncio.AbstractEventLoop:
    if hasattr(selectors, "EpollSelector"):
        return asyncio.SelectorEventLoop(PreciseEpollSelector())
    return asyncio.SelectorEventLoop()


def ask_for_short_slices() -> bool:
    """Asks the kernel for 0.1 ms time slices for the calling thread (EEVDF, Linux 6.12+): a
    task with a short slice has an earlier deadline, so when it wakes it preempts a CPU-bound
    process at once instead of waiting out that one's slice. Measured with other processes
    busy on both cores: a 10 ms RTT came out +2 to +4 ms long in 30% of the measurements
    without it, in none with it. It asks for no more CPU and needs no privilege; an older
    kernel ignores it. True if the kernel took it."""
    numbers = _SCHED_ATTR_SYSCALLS.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = ctypes.create_string_buffer(56)
        if libc.syscall(numbers[1], 0, current, 56, 0) != 0:
            return False
        _, policy, _, nice, priority, _, _, _ = struct.unpack_from("IIQiIQQQ", current.raw)
        if policy != 0:  # SCHED_OTHER only; keep its nice value as it is
            return False
        wanted = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, policy, 0, nice, priority, WAKE_SLICE_NS, 0, 0), 48)
        return libc.syscall(numbers[0], 0, wanted, 0) == 0
    except (OSError, AttributeError):
        return False


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleeps to an absolute time (not for a duration), so that lateness never accumulates.
    Waking from a long sleep is late by ~0.25 ms on a VM (an idle CPU), from a short one by
    ~0.08 ms: a long sleep ends 1 ms early, then a short one hits the time."""
    if when - loop.time() > 0.002:
        await _timer(loop, when - 0.001)
    await _timer(loop, when)


async def _timer(loop: asyncio.AbstractEventLoop, when: float) -> None:
    if when <= loop.time():
        return
    fut = loop.create_future()
    handle = loop.call_at(when, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        handle.cancel()
