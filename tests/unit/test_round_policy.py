"""The round-closing policy on hand-made timelines."""

import pytest

from diloco.coordinator.round_policy import RoundPolicy

pytestmark = pytest.mark.timeout(30)
SITES = {"a", "b", "c", "d"}


def test_without_deadline_a_round_waits_for_every_active_site() -> None:
    p = RoundPolicy(min_sites=2)
    pushed = {"a": 10.0, "b": 11.0, "c": 12.0}
    assert not p.should_close(1e9, 0.0, pushed, SITES)
    assert p.should_close(13.0, 0.0, {**pushed, "d": 13.0}, SITES)
    # An evicted site is no longer active: the others suffice.
    assert p.should_close(13.0, 0.0, pushed, SITES - {"d"})


def test_fixed_deadline_needs_the_quorum() -> None:
    p = RoundPolicy(min_sites=3, deadline="fixed", deadline_s=30)
    assert p.deadline_at(100.0, {}) == 130.0
    two = {"a": 110.0, "b": 112.0}
    assert not p.should_close(200.0, 100.0, two, SITES)  # past the deadline, below the quorum
    three = {**two, "c": 115.0}
    assert not p.should_close(129.9, 100.0, three, SITES)
    assert p.should_close(130.0, 100.0, three, SITES)


def test_median_deadline_leaves_out_a_3x_straggler() -> None:
    p = RoundPolicy(min_sites=2, deadline="median", deadline_factor=1.5)
    assert p.deadline_at(0.0, {"a": 10.0}) is None  # undefined below the quorum
    pushed = {"a": 10.0, "b": 10.5, "c": 11.0}  # median push time 10.5 -> deadline 15.75
    assert p.deadline_at(0.0, pushed) == pytest.approx(15.75)
    assert not p.should_close(15.7, 0.0, pushed, SITES)
    assert p.should_close(15.75, 0.0, pushed, SITES)  # d (3x: ~31 s) is left out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_sites": 0}, "min_sites=0"),
        ({"deadline": "soon"}, "deadline='soon'"),
        ({"deadline_s": 0}, "deadline_s=0"),
        ({"deadline_factor": 0.5}, "deadline_factor=0.5"),
    ],
)
def test_bad_policies_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoundPolicy(**kwargs)
