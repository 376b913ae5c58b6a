"""Shared fixtures of every tier (tests/unit, tests/integration, tests/e2e). This directory is
on sys.path (pytest's rootdir-relative conftest), so tests import ``helpers`` directly."""

from __future__ import annotations

import pytest
from helpers import FakeClock
from hypothesis import settings

# Property tests draw the same examples on every run (CI is reproducible) and have no
# per-example deadline (this machine's timing varies); pytest-timeout bounds each test.
settings.register_profile("diloco", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("diloco")


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
