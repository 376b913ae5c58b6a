"""Fixtures of the WAN emulator tests (test_wan.py, test_wan_process.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from wan_endpoints import Upstream

from diloco.sim.wan import WanEmulator


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def emulate() -> Iterator[Callable[..., tuple[WanEmulator, dict[str, int]]]]:
    """Starts emulators; every one is stopped when the test ends, however it ends."""
    started: list[WanEmulator] = []

    def start(*args: Any, **kwargs: Any) -> tuple[WanEmulator, dict[str, int]]:
        em = WanEmulator(*args, **kwargs)
        started.append(em)
        return em, em.start()

    try:
        yield start
    finally:
        for em in started:
            em.stop()
