"""Every push header field checked on its own (diloco/coordinator/headers.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.headers import MAX_INNER_STEPS, MAX_PARTS, HeaderBounds, header_problem
from diloco.types import PushHeader

pytestmark = pytest.mark.timeout(60)
BOUNDS = HeaderBounds(total_rounds=10, max_tokens=2**40)
GOOD = PushHeader(site_id="eu-1", round=3, tokens=4096, train_loss=2.5, inner_steps=50, part=0, parts=1)


def _with(**changes: object) -> PushHeader:
    import dataclasses

    return dataclasses.replace(GOOD, **changes)  # type: ignore[arg-type]


def test_a_good_header_passes() -> None:
    assert header_problem(GOOD, BOUNDS) is None
    assert header_problem(_with(train_loss=math.nan, part=3, parts=4, round=12), BOUNDS) is None  # past the end: out_of_range elsewhere


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"site_id": "../x"}, "site id '../x' is not valid"),
        ({"site_id": "x" * 10_000}, "…"),
        ({"round": -1}, "round=-1"),
        ({"tokens": 0}, "tokens=0"),
        ({"tokens": 2**40 + 1}, "tokens=1099511627777"),
        ({"inner_steps": -1}, "inner_steps=-1"),
        ({"inner_steps": MAX_INNER_STEPS + 1}, "inner_steps="),
        ({"parts": 0}, "parts=0"),
        ({"parts": MAX_PARTS + 1}, "parts=4097"),
        ({"part": -1}, "part=-1"),
        ({"part": 2, "parts": 2}, "part=2: must be in 0..1"),
        ({"train_loss": math.inf}, "train_loss=inf"),
        ({"train_loss": -1e300}, "train_loss="),
        ({"withheld": "x" * 513}, "withheld: a reason of at most 512"),
        ({"withheld": "lost\x00"}, "printable"),
        ({"withheld": "lost", "part": 1, "parts": 2}, "withheld with parts=2"),
    ],
)
def test_each_bad_field_is_named(changes: dict[str, object], fragment: str) -> None:
    why = header_problem(_with(**changes), BOUNDS)
    assert why is not None and fragment in why
    assert len(why) < 200


@settings(max_examples=300)
@given(
    site_id=st.text(max_size=80),
    round=st.integers(-(2**63), 2**63 - 1),
    tokens=st.integers(-(2**63), 2**63 - 1),
    inner_steps=st.integers(-(2**63), 2**63 - 1),
    part=st.integers(-(2**31), 2**31 - 1),
    parts=st.integers(-(2**31), 2**31 - 1),
    train_loss=st.floats(allow_nan=True, allow_infinity=True),
)
def test_any_header_is_either_fine_or_refused_with_a_short_reason(site_id, round, tokens, inner_steps, part, parts, train_loss) -> None:
    h = PushHeader(site_id=site_id, round=round, tokens=tokens, train_loss=train_loss, inner_steps=inner_steps, part=part, parts=parts)
    why = header_problem(h, BOUNDS)
    if why is None:  # what passes is what the coordinator can take
        assert round >= 0 and 1 <= tokens <= 2**40 and 0 <= inner_steps and 0 <= part < parts <= MAX_PARTS
        assert 1 <= len(site_id) <= 63 and site_id.isascii() and site_id.isprintable()
    else:
        assert len(why) < 200
