"""Leases with a fake clock: heartbeats keep a site in, silence evicts it, a rejoin takes it back."""

import pytest
from helpers import FakeClock

from diloco.coordinator.membership import Membership

pytestmark = pytest.mark.timeout(30)


def test_heartbeats_keep_the_lease_and_silence_evicts() -> None:
    clock = FakeClock(100.0)
    m = Membership(lease_s=10, clock=clock)
    m.join("a")
    m.join("b")
    assert m.active == {"a", "b"} and m.next_expiry() == 110
    clock.t = 108
    m.renew("a")  # a: until 118; b: still until 110
    clock.t = 109.9
    assert m.expire() == []
    clock.t = 110
    assert m.expire() == ["b"]
    assert m.active == {"a"} and m.state("b") == "evicted"
    with pytest.raises(KeyError, match="'b' was evicted: no heartbeat for 10 s"):
        m.renew("b")
    clock.t = 118
    assert m.expire() == ["a"] and m.active == set() and m.next_expiry() is None


def test_rejoin_after_eviction_or_leave_counts_and_renews() -> None:
    clock = FakeClock(100.0)
    m = Membership(lease_s=5, clock=clock)
    m.join("a")
    clock.t = 106
    m.expire()
    member = m.join("a")
    assert member.state == "active" and member.joins == 2 and member.expires_at == 111
    m.join("a")  # a repeated join of an active site is a renewal, not a rejoin
    assert m.snapshot() == {"a": {"state": "active", "joins": 2}}
    m.leave("a")
    assert m.state("a") == "left" and m.active == set()
    with pytest.raises(KeyError, match="has left"):
        m.renew("a")
    assert m.join("a").joins == 3


def test_unknown_sites_and_bad_lease() -> None:
    m = Membership(lease_s=1, clock=FakeClock(100.0))
    with pytest.raises(KeyError, match="'x' has not joined"):
        m.renew("x")
    assert m.state("x") is None and m.known == set()
    with pytest.raises(ValueError, match="lease_s=0"):
        Membership(lease_s=0)
