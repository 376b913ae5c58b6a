"""Shared fixtures of every tier (tests/unit, tests/integration, tests/e2e). This directory is
on sys.path (pytest's rootdir-relative conftest), so tests import ``helpers`` directly."""

from __future__ import annotations

import pytest
from helpers import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
