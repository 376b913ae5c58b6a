"""Shared fixtures of every tier (tests/unit, tests/integration, tests/e2e). This directory is
on sys.path (pytest's rootdir-relative conftest), so tests import ``helpers`` directly."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is first imported: no INFO line per refused handshake

import pytest  # noqa: E402
from helpers import FakeClock  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (CI is reproducible) and have no
# per-example deadline (this machine's timing varies); pytest-timeout bounds each test.
settings.register_profile("diloco", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("diloco")


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]
