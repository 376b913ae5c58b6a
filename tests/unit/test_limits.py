"""What the server lets a caller hold (diloco/transport/limits.py), without a server."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.errors import CoordinatorError
from diloco.transport.limits import PerSite, ServerLimits, StreamWatch

pytestmark = pytest.mark.timeout(30)


def test_a_site_holds_at_most_its_share_of_calls_and_gets_them_back_on_every_path() -> None:
    gate = PerSite(2)
    with gate.hold("a"), gate.hold("a"):
        with pytest.raises(CoordinatorError) as info, gate.hold("a"):
            pass
        assert info.value.kind == "resource_exhausted" and "2 calls in flight" in info.value.message
        with gate.hold("b"):  # another site is not held up
            assert gate.in_flight() == 3
    with pytest.raises(RuntimeError), gate.hold("a"):
        raise RuntimeError("the call failed")
    assert gate.in_flight() == 0


def test_an_idle_stream_is_cancelled_and_an_active_one_is_not() -> None:
    watch = StreamWatch(idle_s=0.3, max_s=60, period_s=0.05)
    cancelled: list[str] = []
    try:
        with watch.track(lambda: cancelled.append("idle")), watch.track(lambda: cancelled.append("active")) as active:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                active.touch()
                time.sleep(0.05)
        assert cancelled == ["idle"] and watch.cancelled == 1
    finally:
        watch.close()


def test_a_stream_past_its_total_time_is_cancelled_even_when_busy() -> None:
    watch = StreamWatch(idle_s=60, max_s=0.2, period_s=0.05)
    done = threading.Event()
    try:
        with watch.track(done.set) as t:
            for _ in range(40):
                t.touch()
                if done.wait(0.05):
                    break
        assert done.is_set()
    finally:
        watch.close()


@pytest.mark.parametrize(("field", "value"), [("max_rpcs", 0), ("max_rpcs_per_site", 1.5), ("stream_idle_s", 0)])
def test_limits_name_a_bad_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"limits.{field}="):
        ServerLimits(**{field: value})
