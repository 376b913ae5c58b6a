"""Streaming fragments, overlap and eager/delayed outer steps through a real gRPC coordinator
on 127.0.0.1:0, on hand-computed traces: every inner step moves each parameter by -1 (a
constant gradient), the outer optimizer is SGD with known rates, so every value the site
pushes, merges and ends with is a small binary fraction computed by hand below."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from diloco.app.config import run_config_from_dict
from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.errors import RemoteError
from diloco.outer import OuterConfig
from diloco.site.loop import RoundLoop
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.sync import RunSettings, SyncConfig, SyncSchedule
from diloco.transport import CoordinatorClient, serve
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)


class TwoLayers(nn.Module):
    """Parameters blocks.0.w and blocks.1.w (two elements each): sync.fragments=2 puts one in each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.ParameterDict({"w": nn.Parameter(torch.zeros(2))}) for _ in range(2)])


def _params(model: nn.Module) -> dict[str, float]:
    return {n: float(p.detach()[0]) for n, p in model.named_parameters()}


class Site:
    """A coordinator (outer SGD) on 127.0.0.1:0 and one site's OuterSync, stopped at the end."""

    def __init__(self, rounds: int, options: SyncOptions, outer: OuterConfig, flush_rounds: int = 0) -> None:
        self.model = TwoLayers()
        theta0 = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}
        config = CoordinatorConfig(total_rounds=rounds, fragments=options.settings.sync.fragments, flush_rounds=flush_rounds)
        self.coordinator = Coordinator(theta0, outer, config)
        self.server, port = serve(self.coordinator, "127.0.0.1", 0)
        self.client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30)
        self.sync = OuterSync(self.model, self.client, "0", options)
        self.pushed: list[dict[str, float]] = []  # Δ of each round, as computed
        self.phase_starts: list[dict[str, float]] = []  # the model when each inner phase began
        self.steps_taken = 0
        self.places: list[tuple[int, int]] = []  # at each landed round: (the schedule's place, the steps taken)
        self.landed_at: list[float] = []  # monotonic, as each landed round is handed on
        self.after_land_s = 0.0
        self.events: list[tuple[str, int]] = []  # ("push", round) at each begin, ("land", round) at each finish
        self.finished: list[object] = []  # every PendingRound finished
        begin, finish = self.sync.begin, self.sync.finish

        def recording_begin(**kw: object) -> object:
            pending = begin(**kw)  # type: ignore[arg-type]
            self.pushed.append({c.name: float(torch.frombuffer(bytearray(c.payload[:4]), dtype=torch.float32)[0]) for c in pending.chunks})
            self.events.append(("push", pending.header.round))
            return pending

        def recording_finish(pending: object) -> str:
            self.events.append(("land", pending.header.round))  # type: ignore[attr-defined]
            self.finished.append(pending)
            return finish(pending)  # type: ignore[arg-type]

        self.sync.begin = recording_begin  # type: ignore[method-assign]
        self.sync.finish = recording_finish  # type: ignore[method-assign]

    def step(self, _round: int, step: int) -> float:
        self.steps_taken += 1
        if step == 0:
            self.phase_starts.append(_params(self.model))
        with torch.no_grad():
            for p in self.model.parameters():
                p.sub_(1.0)
        return 1.0

    def run(self, schedule: SyncSchedule) -> RoundLoop:
        self.sync.join()

        def landed(_pending: object, _digest: str) -> None:
            # what the site's lr schedule is told (site.py) against the steps really taken
            self.places.append((schedule.steps_before(self.sync.round) + loop.phase_steps, self.steps_taken))
            self.landed_at.append(time.monotonic())
            time.sleep(self.after_land_s)  # what follows a landed round (a checkpoint, the final evaluation)

        loop = RoundLoop(self.sync, schedule, self.step, tokens_per_step=1, on_round=landed)
        loop.run()
        return loop

    def close(self) -> None:
        self.sync.close()
        self.client.close()
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def site_factory() -> Iterator:
    made: list[Site] = []

    def make(rounds: int, options: SyncOptions, outer: OuterConfig, flush_rounds: int = 0) -> Site:
        made.append(Site(rounds, options, outer, flush_rounds))
        return made[-1]

    yield make
    for s in made:
        s.close()


SGD_HALF = OuterConfig(name="SGD", lr=0.5, momentum=0.0, nesterov=False)
A, B = "blocks.0.w", "blocks.1.w"


@pytest.mark.parametrize("overlap", [0, 1])
def test_the_utilization_span_ends_when_the_last_round_lands_not_after_what_follows(site_factory, overlap: int) -> None:
    """compute_utilization is inner-step time over joining .. the last round landed: what the
    site does with that round afterwards (the final evaluation, its log) is not training."""
    site = site_factory(2, SyncOptions(), SGD_HALF)
    site.after_land_s = 0.05
    loop = site.run(SyncSchedule(SyncConfig(every=2, overlap=overlap)))
    assert len(site.landed_at) == 2
    assert loop.stats.trained <= loop.stats.ended <= site.landed_at[-1]


def test_two_fragments_overlap_one_step_alpha_half_by_hand(site_factory) -> None:
    # H=4, F=2: a round every 2 steps, fragment r mod 2; τ=1, α=0.5; outer SGD lr 0.5.
    # Local L, global G per fragment, both 0 at first; each step L -= 1.
    # r0: 2 steps -> L=(-2,-2); push frag 0: Δ=0-(-2)=2.
    # r1: step -> (-3,-3); land r0: G0=0-0.5*2=-1, L0=.5*-3+.5*-1=-2; step -> (-3,-4); push frag 1: Δ=0-(-4)=4.
    # r2: step -> (-4,-5); land r1: G1=-2, L1=.5*-5+.5*-2=-3.5; step -> (-5,-4.5); push frag 0: Δ=-1-(-5)=4.
    # r3: step -> (-6,-5.5); land r2: G0=-1-2=-3, L0=.5*-6+.5*-3=-4.5; step -> (-5.5,-6.5); push frag 1: Δ=-2-(-6.5)=4.5.
    # end: land r3: G1=-2-2.25=-4.25, L1=.5*-6.5+.5*-4.25=-5.375.
    site = site_factory(4, SyncOptions.of(fragments=2, local_weight=0.5), SGD_HALF)
    loop = site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1)))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.5}]
    assert {n: float(p[0]) for n, p in site.coordinator.global_params().items()} == {A: -3.0, B: -4.25}
    assert _params(site.model) == {A: -5.5, B: -5.375}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()
    assert loop.steps_per_round == {0: 2, 1: 2, 2: 2, 3: 2}
    assert site.coordinator.fragments == ((A,), (B,))
    assert site.places == [(3, 3), (5, 5), (7, 7), (8, 8)]  # each lands τ=1 step into the next phase


def test_the_delta_merge_keeps_the_overlapped_steps(site_factory) -> None:
    # merge=delta: local ← θ + (local − local at the push). The same schedule as above (τ=1):
    # r0: (-2,-2), push 0: Δ=2 (at push -2). r1: step (-3,-3); land r0: G0=-1, L0=-1+(-3+2)=-2;
    # step (-3,-4); push 1: Δ=4 (at push -4). r2: step (-4,-5); land r1: G1=-2, L1=-2+(-5+4)=-3;
    # step (-5,-4); push 0: Δ=-1+5=4 (at -5). r3: step (-6,-5); land r2: G0=-3, L0=-3+(-6+5)=-4;
    # step (-5,-6); push 1: Δ=-2+6=4 (at -6). End: land r3: G1=-4, L1=-4+0=-4.
    # The pushes are those of blocking fragments (next test): no overlapped step is lost.
    site = site_factory(4, SyncOptions.of(fragments=2, merge="delta"), SGD_HALF)
    site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1)))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.0}]
    assert {n: float(p[0]) for n, p in site.coordinator.global_params().items()} == {A: -3.0, B: -4.0}
    assert _params(site.model) == {A: -5.0, B: -4.0}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()


@pytest.mark.parametrize("overlap", [1, 0])
def test_the_flush_round_is_pushed_while_the_last_round_lands_by_hand(site_factory, overlap: int) -> None:
    # The delta merge's trace above (τ=1; with τ=0 the blocking trace below: the same pushes
    # and θ), then a flush round: fragment A trained steps 7-8 after its last push (r2), so
    # round 4 pushes them and averages them into θ without the outer step. Pushed at step 8,
    # as soon as round 3 is committed, before round 3 lands (τ=1: round 3 is still in flight).
    # r4: Δ_A = G_A − L_A = −3 − (−5) = 2 → θ_A = −3 − 2 = −5 (an outer step would be −4).
    # r3 lands: G_B = −2 − .5·4 = −4, L_B = −4. θ = model = (−5, −4).
    site = site_factory(5, SyncOptions.of(fragments=2, merge="delta"), SGD_HALF, flush_rounds=1)
    loop = site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=overlap), train_rounds=4))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.0}, {A: 2.0}]
    assert {n: float(p[0]) for n, p in site.coordinator.global_params().items()} == {A: -5.0, B: -4.0}
    assert _params(site.model) == {A: -5.0, B: -4.0}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()
    assert loop.steps_per_round == {0: 2, 1: 2, 2: 2, 3: 2, 4: 0}
    tail = [("push", 3), ("push", 4), ("land", 3), ("land", 4)] if overlap else [("push", 3), ("land", 3), ("push", 4), ("land", 4)]
    assert site.events[-4:] == tail
    # A round finished again after θ moved past it (a pipelined round after one that caught
    # up) changes nothing.
    digest, theta = site.sync.global_sha256(), _params(site.model)
    assert site.sync.finish(site.finished[3]) == digest and _params(site.model) == theta and site.sync.round == 5


def test_frozen_fragments_stop_at_their_last_push_and_need_no_flush_round_by_hand(site_factory) -> None:
    # fragment_end=freeze: the delta merge's trace (τ=1) until round 2, the last of fragment A:
    # from its push (at −5) A keeps its value while B trains on, and when round 2 lands A ← θ_A.
    # r2: push A: Δ=−1+5=4 (at −5); A frozen. r3: step (−5,−5); land r2: G_A=−1−2=−3,
    # L_A=−3+(−5+5)=−3; step (−3,−6); push B: Δ=−2+6=4 (at −6), the run's last round.
    # End: land r3: G_B=−2−2=−4, L_B=−4. No flush round: θ = model = (−3, −4) (flush: −5, −4).
    site = site_factory(4, SyncOptions.of(fragments=2, merge="delta"), SGD_HALF)
    loop = site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1, end="freeze"), train_rounds=4))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.0}]
    assert {n: float(p[0]) for n, p in site.coordinator.global_params().items()} == {A: -3.0, B: -4.0}
    assert _params(site.model) == {A: -3.0, B: -4.0}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()
    assert loop.steps_per_round == {0: 2, 1: 2, 2: 2, 3: 2} and site.steps_taken == 8  # the same tokens
    assert loop.frozen.names == {A, B}


def test_a_site_joining_after_a_fragments_last_push_keeps_it_frozen(site_factory) -> None:
    # The loop starts at round 3 (as a site restarted there would): fragment A's last round (2)
    # is behind it, so A stays where it is while B trains: at the second step A is still 0.
    site = site_factory(4, SyncOptions.of(fragments=2, merge="delta"), SGD_HALF)
    site.sync.join()
    site.sync.round = 3
    site.sync.join = lambda: None  # type: ignore[method-assign]
    seen: list[dict[str, float]] = []
    step = site.step
    site.step = lambda r, k: (seen.append(_params(site.model)), step(r, k))[1]  # type: ignore[method-assign]
    loop = site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1, end="freeze"), train_rounds=4))
    assert seen == [{A: 0.0, B: 0.0}, {A: 0.0, B: -1.0}]
    assert site.pushed == [{B: 2.0}] and loop.frozen.names >= {A}


def test_blocking_fragments_replace_each_landed_fragment(site_factory) -> None:
    # The same with τ=0, α=0: each round lands before the next step and replaces its fragment.
    # r0: (-2,-2), Δ0=2, G0=-1, L0=-1. r1: (-3,-4), Δ1=4, G1=-2, L1=-2.
    # r2: (-5,-4), Δ0=-1+5=4, G0=-3, L0=-3. r3: (-5,-6), Δ1=-2+6=4, G1=-4, L1=-4.
    site = site_factory(4, SyncOptions.of(fragments=2), SGD_HALF)
    site.run(SyncSchedule(SyncConfig(every=4, fragments=2)))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.0}]
    assert _params(site.model) == {A: -5.0, B: -4.0}  # fragment 0 trained on after r2
    assert site.sync.global_sha256() == site.coordinator.global_sha256()


SGD_MOMENTUM = OuterConfig(name="SGD", lr=0.5, momentum=0.5, nesterov=False)


def test_the_ahead_merge_with_one_site_and_weight_one_is_blocking_fragments_by_hand(site_factory) -> None:
    # merge=ahead: at the push the fragment moves by the outer step as the site can foresee it
    # (SGD lr .5, momentum .5, heavy ball; the own Δ, weight 1, for the mean), the τ=1 step is
    # taken from there, and the landing keeps it: L ← G + (L − L at the push, looked ahead).
    # r0: (-2,-2), push A: Δ=2, no buffer yet: A -= .5*2 -> (-3,-2). r1: step (-4,-3); land r0:
    # G_A=-1 (buf 2), A=-1+(-4+3)=-2; step (-3,-4); push B: Δ=4, B -= 2 -> (-3,-6). r2: step
    # (-4,-7); land r1: G_B=-2 (buf 4), B=-2+(-7+6)=-3; step (-5,-4); push A: Δ=-1+5=4,
    # A -= .5*(.5*2+4) -> (-7.5,-4). r3: step (-8.5,-5); land r2: buf_A=5, G_A=-3.5,
    # A=-3.5+(-8.5+7.5)=-4.5; step (-5.5,-6); push B: Δ=-2+6=4, B -= .5*(.5*4+4) -> (-5.5,-9).
    # End: land r3: buf_B=6, G_B=-5, B=-5. One site's look-ahead is the outer step itself, so
    # the pushes, θ and the model are blocking fragments' (Δ 2, 4, 4, 4; θ (-3.5, -5)).
    site = site_factory(4, SyncOptions.of(fragments=2, merge="ahead", outer=SGD_MOMENTUM, lookahead_weight=1.0), SGD_MOMENTUM)
    site.run(SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1)))
    assert site.pushed == [{A: 2.0}, {B: 4.0}, {A: 4.0}, {B: 4.0}]
    assert {n: float(p[0]) for n, p in site.coordinator.global_params().items()} == {A: -3.5, B: -5.0}
    assert _params(site.model) == {A: -5.5, B: -5.0}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()


@pytest.mark.parametrize(
    "mode, starts",
    [
        # eager (1 site, weight 1: the own Δ stands in for the whole mean): each phase starts
        # from θ moved by the outer step in flight, SGD(lr .5, momentum .5) taken with the own Δ
        # and the coordinator's buffer as recovered from the updates. p0=0; phase 0 -> -2, Δ0=2:
        # buf=2, p1=0-.5*2=-1. Phase 1 -> -3; land r0: u=-1, so g=2, buf=2, G=-1; Δ1=-1+3=2:
        # buf .5*2+2=3, p2=-1-1.5=-2.5. Phase 2 -> -4.5; land r1: buf=3, G=-2.5; Δ2=2.
        # With one site these are blocking DiLoCo's start points.
        ("eager", [0.0, -1.0, -2.5]),
        # delayed: each phase starts from θ as known (one round old): p1=0, p2=G after r0=-1.
        ("delayed", [0.0, 0.0, -1.0]),
    ],
)
def test_eager_and_delayed_start_points_by_hand(site_factory, mode: str, starts: list[float]) -> None:
    # Both push Δ = 2 every round (the phase's own progress); the coordinator's θ is then the
    # same SGD(lr .5, momentum .5) sequence: G = -1, -2.5, then buf=.5*3+2=3.5 -> -4.25; the
    # model ends at θ.
    weight = {"lookahead_weight": 1.0} if mode == "eager" else {}  # delayed does not look ahead
    site = site_factory(3, SyncOptions.of(mode=mode, outer=SGD_MOMENTUM, **weight), SGD_MOMENTUM)
    loop = site.run(SyncSchedule(SyncConfig(every=2, mode=mode)))
    assert [s[A] for s in site.phase_starts] == starts
    assert [p[A] for p in site.pushed] == [2.0, 2.0, 2.0]
    assert _params(site.model) == {A: -4.25, B: -4.25}
    assert site.sync.global_sha256() == site.coordinator.global_sha256()
    assert loop.stats.stall_s >= 0 and loop.stats.compute_utilization is not None
    # A round lands after the next phase: the lr schedule is told every step taken (it was
    # told one phase fewer, so each phase ran at the lr of the one before).
    assert site.places == [(4, 4), (6, 6), (6, 6)]


def test_a_push_of_another_fragment_is_refused_saying_so(site_factory) -> None:
    site = site_factory(4, SyncOptions.of(fragments=2), SGD_HALF)
    site.sync.join()
    header = PushHeader(site_id="0", round=0, tokens=1, train_loss=1.0, inner_steps=1)
    chunks = list(encode_chunks({B: torch.ones(2)}, codec=get_codec("fp32")))
    with pytest.raises(RemoteError) as e:
        site.client.push(header, iter(chunks))
    assert e.value.kind == "invalid_argument"
    assert "of fragment 1; round 0 syncs fragment 0 of 2" in str(e.value)
    assert site.coordinator.committed_rounds == 0


def test_a_site_stating_another_split_is_refused_at_join_and_one_stating_nothing_gets_the_runs() -> None:
    settings = run_config_from_dict({"rounds": 2, "sync": {"every": 4, "fragments": 2}}).settings
    model = TwoLayers()
    theta0 = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    coord = Coordinator(theta0, SGD_HALF, CoordinatorConfig.of_run(settings))
    server, port = serve(coord, "127.0.0.1", 0)
    specs = tuple(fingerprint(theta0).values())
    try:
        with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30) as client:
            with pytest.raises(RemoteError, match=r"sync.fragments=1 \(the run's: 2\)") as e:
                client.join(JoinRequest("0", specs, stated={"sync.fragments": 1}))
            assert e.value.kind == "invalid_argument"
            with pytest.raises(RemoteError, match=r'sync.split="balanced" \(the run\'s: "strided"\)'):
                client.join(JoinRequest("0", specs, stated={"sync.fragments": 2, "sync.split": "balanced"}))
            with pytest.raises(RemoteError, match="'sync.colour': not a run setting"):
                client.join(JoinRequest("0", specs, stated={"sync.colour": 1}))
            info = client.join(JoinRequest("0", specs, stated={"sync.streams": 4}))  # a site's own: never refused
            assert RunSettings.from_dict(info.settings) == settings  # type: ignore[arg-type]
            assert info.fragments == ((A,), (B,))  # the split, handed out
    finally:
        server.stop(grace=None).wait(5)


def test_a_diverged_blocking_round_is_withheld_and_the_site_goes_on_from_theta_by_hand(site_factory) -> None:
    # H=2, outer SGD lr 0.5, one site. r0: L=-2, Δ=2, G=-1. r1: a NaN after its last step:
    # withheld, the round (no Δ counted) leaves G=-1, the model is G again and the caller's
    # reset runs. r2: L=-3, Δ=2, G=-2.
    site = site_factory(3, SyncOptions(), SGD_HALF)
    resets: list[int] = []
    site.sync.on_diverged = lambda: resets.append(site.sync.round)
    site.step = _diverging(site.step, site.model, at_round=1, last_step=1)  # type: ignore[method-assign]
    site.run(SyncSchedule(SyncConfig(every=2)))
    assert site.pushed == [{A: 2.0, B: 2.0}, {}, {A: 2.0, B: 2.0}]
    assert site.sync.stats.diverged_rounds == [1] and len(resets) == 1
    assert _params(site.model) == {A: -2.0, B: -2.0} and site.sync.global_sha256() == site.coordinator.global_sha256()
    assert site.coordinator.recent_records()[1]["rejected"]


@pytest.mark.parametrize(
    "options, schedule",
    [
        (SyncOptions.of(fragments=2, local_weight=0.5), SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1))),
        (SyncOptions.of(fragments=2, merge="delta"), SyncSchedule(SyncConfig(every=4, fragments=2, overlap=1))),
        (SyncOptions.of(mode="eager", outer=SGD_HALF), SyncSchedule(SyncConfig(every=2, mode="eager"))),
        (SyncOptions.of(mode="delayed"), SyncSchedule(SyncConfig(every=2, mode="delayed"))),
    ],
    ids=["overlap-alpha", "overlap-delta", "eager", "delayed"],
)
def test_a_diverged_round_leaves_no_nan_behind_in_every_sync_mode(site_factory, options: SyncOptions, schedule: SyncSchedule) -> None:
    """Whatever merges the site does, after a diverged round it restarts from θ: the model,
    θ and every later push are finite, and the site's θ is the coordinator's."""
    site = site_factory(4, options, SGD_HALF)
    resets: list[int] = []
    site.sync.on_diverged = lambda: resets.append(1)
    site.step = _diverging(site.step, site.model, at_round=1, last_step=1)  # type: ignore[method-assign]
    site.run(schedule)
    assert site.sync.stats.diverged_rounds == [1] and resets == [1]
    assert site.pushed[1] == {} and all(all(torch.isfinite(torch.tensor(v)) for v in p.values()) for p in site.pushed)
    assert all(torch.isfinite(p).all() for p in site.model.parameters())
    assert site.sync.global_sha256() == site.coordinator.global_sha256()
    assert all(torch.isfinite(p).all() for p in site.coordinator.global_params().values())


def _diverging(step, model: nn.Module, at_round: int, last_step: int):
    """``step``, after which (in round ``at_round``, at step ``last_step``) every parameter is NaN."""

    def diverging(round: int, i: int) -> float:
        loss = step(round, i)
        if round == at_round and i == last_step:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        return loss

    return diverging


# ---- connection striping ------------------------------------------------------------------

from diloco.data import DataConfig, ShardSampler, load_corpus  # noqa: E402
from diloco.model import build_model, model_config  # noqa: E402
from diloco.site.inner import InnerConfig, InnerTrainer  # noqa: E402

MODEL = model_config("tiny", context=32, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64)


def _striped_run(streams: int, codec: str) -> tuple[str, str, int]:
    """2 rounds of H=3 of one site over ``streams`` streams; (site hash, coordinator hash, bytes up)."""
    coordinator = Coordinator(dict(build_model(MODEL, seed=0).named_parameters()), OuterConfig(), CoordinatorConfig(total_rounds=2))
    server, port = serve(coordinator, "127.0.0.1", 0)
    try:
        model = build_model(MODEL, seed=1)
        trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=1), total_steps=6)
        corpus = load_corpus(DataConfig(batch_size=4), MODEL.context, num_shards=1)
        sampler = ShardSampler(corpus.train, shard=0, num_shards=1, batch_size=4, context=MODEL.context, seed=0)
        with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30, streams=streams) as client:
            sync = OuterSync(model, client, "0", SyncOptions.of(codec=codec, streams=streams))
            sync.join()
            RoundLoop(sync, SyncSchedule(SyncConfig(every=3)), lambda _r, _s: trainer.step(*sampler.next_batch()), tokens_per_step=128).run()
            sync.close()
            return sync.global_sha256(), coordinator.global_sha256(), sync.stats.bytes_up
    finally:
        server.stop(grace=None).wait(5)


def test_a_striped_push_and_pull_give_the_same_theta_as_one_stream() -> None:
    one, coord_one, up_one = _striped_run(1, "fp32")
    three, coord_three, up_three = _striped_run(3, "fp32")
    assert one == coord_one and three == coord_three
    assert three == one  # fp32 is lossless: the parts add up to exactly the same Δ
    assert up_three == up_one


def test_a_striped_lossy_push_keeps_every_copy_identical() -> None:
    site, coordinator, _ = _striped_run(4, "int8")
    assert site == coordinator


def test_stripes_tile_every_tensor_and_balance_the_elements() -> None:
    from diloco.boxes import Box, tiling_problem
    from diloco.site.stripes import stripe_boxes

    shapes = {n: tuple(p.shape) for n, p in build_model(MODEL, seed=0).named_parameters()}
    held = {n: Box.whole(s) for n, s in shapes.items()}
    stripes = stripe_boxes(held, shapes, 4)
    assert len(stripes) == 4
    for name, shape in shapes.items():
        assert tiling_problem([s[name] for s in stripes if name in s], shape) is None
    sizes = [sum(b.numel for b in s.values()) for s in stripes]
    assert max(sizes) <= 1.2 * sum(sizes) / 4
