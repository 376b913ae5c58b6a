"""The staging pool on its own: a buffer per push, one push per site, every buffer given back
on every path, and the buffer of a holder that waits for input for ``stall_s`` given to a push
that waits for one, never that of a holder making progress; the evicted holder is refused
when it goes on and never writes into the buffer it lost."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from helpers import FakeClock

from diloco.coordinator import CoordinatorConfig, CoordinatorError
from diloco.coordinator.staging import Lease, StagingPool

pytestmark = pytest.mark.timeout(30)


def test_a_lease_is_surrendered_only_after_its_holder_waited_stall_s_for_input(fake_clock: FakeClock) -> None:
    lease = Lease({}, "a", fake_clock)
    fake_clock.t += 100
    assert not lease.surrender(fake_clock.t, 2.0)  # decoding (not idle), however long: never
    with lease.idle():  # a chunk arrives in time: progress
        fake_clock.t += 1.9
        assert not lease.surrender(fake_clock.t, 2.0)
    fake_clock.t += 100  # decoding again
    assert not lease.surrender(fake_clock.t, 2.0)
    with pytest.raises(CoordinatorError) as refused:
        with lease.idle():
            fake_clock.t += 1.9
            assert not lease.surrender(fake_clock.t, 2.0)  # the wait counts from the last progress
            fake_clock.t += 0.1
            assert lease.surrender(fake_clock.t, 2.0)
    assert refused.value.kind == "resource_exhausted"
    for says in ("site 'a'", "no chunk for 2.0 s", "other pushes waited", "staging_stall_s=2", "given to another push", "nothing of this push was counted"):
        assert says in refused.value.message


def test_a_waiting_push_takes_the_buffer_of_the_holder_stalled_longest_and_the_holder_writes_nothing(fake_clock: FakeClock) -> None:
    pool = StagingPool(2, timeout_s=30.0, stall_s=2.0, clock=fake_clock)
    with pool.take("a") as a, pool.take("b") as b:
        a.buffer["w"] = torch.full((3,), 1.0)
        with pytest.raises(CoordinatorError, match="given to another push") as refused:
            with a.idle():  # a waits for its next chunk
                fake_clock.t += 1.0
                with b.idle():  # b too, for less long
                    fake_clock.t += 2.5
                    with pool.take("c") as c:
                        assert c.buffer is a.buffer  # a's: stalled 3.5 s, b only 2.5 s
                        c.buffer["w"].fill_(3.0)
            a.buffer["w"].fill_(2.0)  # what a would write next: never reached
        assert refused.value.kind == "resource_exhausted"
        assert torch.equal(a.buffer["w"], torch.full((3,), 3.0))  # c's values, none of a's after it lost the buffer
    assert pool.free == 2  # a's buffer came back with c, b's with b


def test_a_holder_making_progress_keeps_its_buffer_and_the_waiting_push_is_refused() -> None:
    pool = StagingPool(1, timeout_s=0.2, stall_s=0.01)
    with pool.take("a") as a:  # decoding all along: never idle
        with pytest.raises(CoordinatorError, match="stayed busy") as refused:
            with pool.take("b"):
                pass
        assert refused.value.kind == "resource_exhausted"
        a.buffer["w"] = torch.zeros(2)  # still a's
    long_stall = StagingPool(1, timeout_s=0.2, stall_s=600.0)
    with long_stall.take("a") as a, a.idle():  # waiting, but not yet for stall_s
        with pytest.raises(CoordinatorError, match="stayed busy"):
            with long_stall.take("b"):
                pass
    assert pool.free == 1 and long_stall.free == 1


def test_a_push_that_waits_gets_the_buffer_once_its_holder_has_stalled() -> None:
    """Across threads with the real clock: the push that waits for a buffer is handed it once the
    holder's wait for input has lasted stall_s, not at its own timeout."""
    pool = StagingPool(1, timeout_s=600.0, stall_s=0.05)
    idle, resume, outcome = threading.Event(), threading.Event(), []

    def stalled_holder() -> None:
        try:
            with pool.take("a") as a, a.idle():
                idle.set()
                resume.wait(30)
            outcome.append("went on")
        except CoordinatorError as e:
            outcome.append(e.kind)

    holder = threading.Thread(target=stalled_holder)
    holder.start()
    try:
        assert idle.wait(30)
        with pool.take("b") as b:
            b.buffer["w"] = torch.ones(2)
        assert holder.is_alive() and outcome == []  # taken while the holder still waits
    finally:
        resume.set()
        holder.join(30)
    assert outcome == ["resource_exhausted"] and pool.free == 1


def test_one_push_per_site_and_every_buffer_comes_back_on_every_path(fake_clock: FakeClock) -> None:
    pool = StagingPool(2, timeout_s=30.0, stall_s=2.0, clock=fake_clock)
    with pool.take("a"):
        with pytest.raises(CoordinatorError, match="site 'a' has a push being decoded already") as refused:
            with pool.take("a"):
                pass
        assert refused.value.kind == "resource_exhausted" and pool.free == 1
    with pytest.raises(ValueError):
        with pool.take("a"):
            raise ValueError("a push that failed half-way")
    with pytest.raises(CoordinatorError):  # evicted: its buffer serves c, then comes back
        with pool.take("a") as a, a.idle():
            fake_clock.t += 2.0
            with pool.take("b"), pool.take("c"):
                with pytest.raises(CoordinatorError, match="site 'a' has a push being decoded already"):
                    with pool.take("a"):  # the evicted push is still answered first
                        pass
    assert pool.free == 2
    with pool.take("a"), pool.take("b"):  # and every site can push again
        assert pool.free == 0


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_the_stall_time_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match=f"staging_stall_s={value}: must be > 0"):
        CoordinatorConfig(total_rounds=1, staging_stall_s=value)
