"""A site that looks ahead of the outer step (outer_mode=eager, merge=ahead) follows the
coordinator's momentum buffer. One that ran all along recovers it from the updates it
applied; one that (re)joins mid-run pulls it with θ, in the same PullGlobal answer (so both
are of one round), through a real gRPC coordinator on 127.0.0.1:0. The trace is by hand:
every inner step moves each parameter by -1, the outer step is SGD(lr .5, momentum .5)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from diloco.boxes import Box
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.errors import RemoteError
from diloco.outer import OuterConfig
from diloco.site.loop import RoundLoop
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.sync import SyncConfig, SyncSchedule
from diloco.transport import CoordinatorClient, serve
from diloco.types import JoinRequest
from diloco.wire import ChunkAssembler

pytestmark = pytest.mark.timeout(60)

SGD_MOMENTUM = OuterConfig(name="SGD", lr=0.5, momentum=0.5, nesterov=False)
EAGER = SyncOptions.of(mode="eager", outer=SGD_MOMENTUM, lookahead_weight=1.0)


def _model() -> nn.Module:
    return nn.ParameterDict({"a": nn.Parameter(torch.zeros(3)), "b": nn.Parameter(torch.zeros(2, 2))})


class Run:
    """A coordinator on 127.0.0.1:0 and a client to it, stopped at the end."""

    def __init__(self, rounds: int, outer: OuterConfig) -> None:
        theta0 = {n: torch.zeros_like(p) for n, p in _model().named_parameters()}
        self.coordinator = Coordinator(theta0, outer, CoordinatorConfig(total_rounds=rounds))
        self.server, port = serve(self.coordinator, "127.0.0.1", 0)
        self.client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30)
        self.syncs: list[OuterSync] = []

    def site(self, options: SyncOptions = EAGER) -> OuterSync:
        sync = OuterSync(_model(), self.client, "0", options)
        self.syncs.append(sync)
        return sync

    def close(self) -> None:
        for s in self.syncs:
            s.close()
        self.client.close()
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def run_factory() -> Iterator:
    made: list[Run] = []

    def make(rounds: int, outer: OuterConfig = SGD_MOMENTUM) -> Run:
        made.append(Run(rounds, outer))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _train(sync: OuterSync, rounds: int) -> None:
    """Eager rounds of 2 inner steps, each moving every parameter by -1: Δ = 2 every round."""

    def step(_round: int, _step: int) -> float:
        with torch.no_grad():
            for p in sync.layout.model.parameters():
                p.sub_(1.0)
        return 1.0

    sync.join()
    RoundLoop(sync, SyncSchedule(SyncConfig(every=2, mode="eager")), step, tokens_per_step=1).run()
    assert sync.round == rounds


def _assembled(chunks: list, sync: OuterSync) -> dict[str, torch.Tensor]:
    assembler = ChunkAssembler(dict(sync.layout.specs))
    for c in chunks:
        assembler.add(c)
    return assembler.finish()


def test_a_site_joining_mid_run_follows_the_coordinators_momentum_as_the_site_that_ran_does(run_factory) -> None:
    # Every round pushes Δ = 2: the buffer is 2, then .5*2+2 = 3, then .5*3+2 = 3.5.
    run = run_factory(3)
    first = run.site()
    _train(first, 3)
    momentum = run.coordinator.shard.outer.momentum_buffers()
    assert {n: b.flatten()[0].item() for n, b in momentum.items()} == {"a": 3.5, "b": 3.5}
    # The site that ran all along recovered it from the three updates it applied.
    assert {n: torch.equal(b, momentum[n]) for n, b in first._lookahead.buffer.items()} == {"a": True, "b": True}
    # The same site started again (a fresh process: no look-ahead of its own) pulls it with θ.
    again = run.site()
    before = again.stats.bytes_down
    again.join()
    assert again.round == 3
    assert {n: torch.equal(b, momentum[n]) for n, b in again._lookahead.buffer.items()} == {"a": True, "b": True}
    assert again._lookahead.mean is None
    # θ and the momentum came down: two float32 copies of the 7 parameters.
    assert again.stats.bytes_down - before == 2 * 7 * 4
    assert again.global_sha256() == run.coordinator.global_sha256()


def test_the_momentum_comes_with_theta_of_the_same_round_and_only_when_asked(run_factory) -> None:
    run = run_factory(3)
    site = run.site(SyncOptions())
    site.join()
    # Before the first outer step there is nothing to follow: no momentum chunks at all.
    status, chunks, momentum = run.client.pull_global_with_state("0")
    assert status.committed_rounds == 0 and momentum == []
    _train(run.site(), 3)
    status, chunks, momentum = run.client.pull_global_with_state("0")
    plain_status, plain_chunks = run.client.pull_global("0")
    assert status == plain_status and status.committed_rounds == 3
    assert {n: torch.equal(t, run.coordinator.global_params()[n]) for n, t in _assembled(chunks, site).items()} == {"a": True, "b": True}
    assert {n: torch.equal(t, run.coordinator.shard.outer.momentum_buffers()[n]) for n, t in _assembled(momentum, site).items()} == {"a": True, "b": True}
    assert sum(len(c.payload) for c in plain_chunks) == sum(len(c.payload) for c in chunks)
    # A pull of slices gets the momentum's slices too.
    _, part, part_momentum = run.client.pull_global_with_state("0", {"b": Box(start=(1, 0), shape=(1, 2))})
    assert {c.name for c in part} == {c.name for c in part_momentum} == {"b"}


def test_an_outer_step_with_no_momentum_to_follow_is_refused_naming_it(run_factory) -> None:
    run = run_factory(2, OuterConfig(name="AdamW", lr=0.1))
    run.client.join(JoinRequest("0", tuple(run.site(SyncOptions()).layout.specs.values())))
    with pytest.raises(RemoteError) as e:
        run.client.pull_global_with_state("0")
    assert e.value.kind == "failed_precondition"
    assert "the outer step is AdamW, not SGD" in str(e.value)
    status, _ = run.client.pull_global("0")  # θ alone is served as before
    assert status.committed_rounds == 0
