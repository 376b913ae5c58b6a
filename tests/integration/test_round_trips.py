"""The round trips of one round over real gRPC on 127.0.0.1:0: a site sends its pull right
behind its push, and the coordinator holds it until the round closes, so a slow link pays one
round trip for push, wait and pull together instead of three (push, WaitRound, PullUpdate).

Checked by order, not by time: a coordinator that answers a push only once the site's pull for
that round has reached it. A site that waited for the push's answer before pulling would
never get that answer."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig, params_sha256
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.transport import CoordinatorClient, serve
from diloco.types import Chunk, PushHeader, PushResult

pytestmark = pytest.mark.timeout(60)


class PullFirst:
    """A Coordinator that answers a push only after a pull of the same round arrived (at most
    ``patience_s``), and records the calls it served."""

    def __init__(self, coordinator: Coordinator, patience_s: float) -> None:
        self._c, self._patience_s = coordinator, patience_s
        self._pulled: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.calls: list[tuple[str, int]] = []
        self.waited_out: list[int] = []  # rounds whose push was answered without a pull in time

    def _event(self, round: int) -> threading.Event:
        with self._lock:
            return self._pulled.setdefault(round, threading.Event())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def push(self, header: PushHeader, chunks: Iterable[Chunk]) -> PushResult:
        self.calls.append(("push", header.round))
        result = self._c.push(header, chunks)
        if not self._event(header.round).wait(self._patience_s):
            self.waited_out.append(header.round)
        return result

    def wait_round(self, site_id: str, round: int, timeout_s: float, gave_up: Any = None) -> Any:
        self.calls.append(("wait_round", round))
        return self._c.wait_round(site_id, round, timeout_s, gave_up)

    def pull_update(self, site_id: str, round: int, want: Any = None, wait_s: float = 0.0, gave_up: Any = None, early: bool = False) -> Any:
        self.calls.append(("pull", round))
        self._event(round).set()
        return self._c.pull_update(site_id, round, want, wait_s=wait_s, gave_up=gave_up, early=early)


@pytest.fixture
def site() -> Iterator[tuple[PullFirst, OuterSync, nn.Module]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    coordinator = PullFirst(Coordinator(theta0, OuterConfig(), CoordinatorConfig(total_rounds=3)), patience_s=10.0)
    server, port = serve(coordinator, "127.0.0.1", 0)  # type: ignore[arg-type]  # a CoordinatorService by delegation
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30)
    sync = OuterSync(model, client, "0", SyncOptions.of(codec="fp32"))
    try:
        yield coordinator, sync, model
    finally:
        sync.close()
        client.close()
        server.stop(grace=None).wait(5)


def test_the_pull_follows_the_push_without_waiting_for_its_answer(site) -> None:
    coordinator, sync, model = site
    sync.join()
    for r in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (r + 1))
        sync.sync(tokens=1, train_loss=1.0, inner_steps=1)
    assert coordinator.waited_out == []  # every push was answered because its pull was already there
    # One push and one pull per round, no WaitRound (a push and the pull behind it may reach
    # their handlers in either order).
    assert sorted(coordinator.calls) == [("pull", 0), ("pull", 1), ("pull", 2), ("push", 0), ("push", 1), ("push", 2)]
    assert params_sha256(sync.global_params) == coordinator.global_sha256()
    assert all(t["wait_s"] >= 0 and t["pull_s"] >= 0 for t in sync.stats.timings)
