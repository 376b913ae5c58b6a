"""The eager start point's look-ahead (diloco.outer.eager) against the coordinator's own outer
optimizer: from the updates alone a site follows the coordinator's momentum exactly, so with
one site and weight 1 every phase starts at the θ blocking DiLoCo would start it from."""

from __future__ import annotations

import copy

import pytest
import torch

from diloco.outer import OuterConfig, OuterOptimizer
from diloco.outer.eager import EagerStart, check_eager_outer

pytestmark = pytest.mark.timeout(30)

SHAPES = {"a": torch.Size([3]), "b": torch.Size([2, 2])}
ROUNDS = 8


def _deltas(rounds: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(rounds)]


def _coordinators_outer_optimizer(cfg: OuterConfig) -> OuterOptimizer:
    """The outer optimizer a coordinator runs, from θ = 0: what the eager look-ahead follows."""
    return OuterOptimizer({n: torch.zeros(s) for n, s in SHAPES.items()}, cfg, steps=ROUNDS)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for n in SHAPES:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-5)


OUTER = [
    OuterConfig(name="SGD", lr=0.7, momentum=0.9, nesterov=True),
    OuterConfig(name="SGD", lr=0.5, momentum=0.5, nesterov=False),
    OuterConfig(name="SGD", lr=1.0, momentum=0.9, nesterov=True, momentum_warmup=4, lr_decay="cosine", lr_min_ratio=0.1),
    OuterConfig(name="SGD", lr=0.7, momentum=0.0, nesterov=False),
]
IDS = ["nesterov", "heavy-ball", "rule-like-schedule", "no-momentum"]


@pytest.mark.parametrize("cfg", OUTER, ids=IDS)
def test_one_site_with_weight_one_starts_every_phase_at_blockings_theta(cfg: OuterConfig) -> None:
    coordinator, eager = _coordinators_outer_optimizer(cfg), EagerStart(cfg, ROUNDS, weight=1.0)
    for k, delta in enumerate(_deltas(ROUNDS)):
        theta = {n: p.clone() for n, p in coordinator.params.items()}
        offset = eager.offset(k, delta)  # pushed; the round is in flight
        update = coordinator.step(delta, round=k)  # it lands: θ_{k+1}
        _close({n: theta[n] + offset[n] for n in SHAPES}, coordinator.params)
        eager.observe(k, update)
        _close(eager.mean[1], delta)  # the round's mean, recovered from its update  # type: ignore[index]


@pytest.mark.parametrize("cfg", OUTER[:3], ids=IDS[:3])
def test_with_several_sites_the_look_ahead_takes_the_weighted_own_delta_for_the_mean(cfg: OuterConfig) -> None:
    # 4 sites; this one is site 0. The look-ahead of round k is the coordinator's step k (its
    # rates, its buffer) taken with x = w·Δ_k(own) in place of the mean still in flight.
    sites, w = 4, 0.5
    coordinator, eager = _coordinators_outer_optimizer(cfg), EagerStart(cfg, ROUNDS, weight=w)
    for k in range(ROUNDS):
        pushes = _deltas(sites, seed=k)
        offset = eager.offset(k, pushes[0])
        trial = copy.deepcopy(coordinator)
        before = {n: p.clone() for n, p in trial.params.items()}
        trial.step({n: w * pushes[0][n] for n in SHAPES}, round=k)
        _close(offset, {n: trial.params[n] - before[n] for n in SHAPES})
        mean = {n: sum(p[n] for p in pushes) / sites for n in SHAPES}
        eager.observe(k, coordinator.step(mean, round=k))
        _close(eager.mean[1], mean)  # type: ignore[index]


@pytest.mark.parametrize("cfg", OUTER[:3], ids=IDS[:3])
def test_with_fragments_each_parameter_follows_the_rounds_of_its_own_fragment(cfg: OuterConfig) -> None:
    # F = 2: round r syncs fragment r mod 2 at outer step r // 2 (its rates), as the
    # coordinator's optimizer counts them; each parameter's buffer starts at its own round.
    frags = (("a",), ("b",))
    coordinator = OuterOptimizer({n: torch.zeros(s) for n, s in SHAPES.items()}, cfg, steps=ROUNDS, fragments=2)
    eager = EagerStart(cfg, ROUNDS, weight=1.0, fragments=2)
    for r, delta in enumerate(_deltas(2 * ROUNDS, seed=3)):
        names = frags[r % 2]
        delta = {n: delta[n] for n in names}
        theta = {n: coordinator.params[n].clone() for n in names}
        offset = eager.offset(r, delta)
        update = coordinator.step(delta, round=r)
        for n in names:
            torch.testing.assert_close(theta[n] + offset[n], coordinator.params[n], rtol=1e-5, atol=1e-5)
        eager.observe(r, update)
    assert set(eager.buffer) == set(SHAPES)


@pytest.mark.parametrize("cfg", OUTER[:3], ids=IDS[:3])
def test_weight_zero_looks_ahead_by_the_momentum_alone(cfg: OuterConfig) -> None:
    # merge=ahead's w = 0: the part of the outer step a site knows before the mean lands.
    coordinator, eager = _coordinators_outer_optimizer(cfg), EagerStart(cfg, ROUNDS, weight=0.0)
    for k, delta in enumerate(_deltas(ROUNDS, seed=5)):
        offset = eager.offset(k, delta)
        trial = copy.deepcopy(coordinator)
        before = {n: p.clone() for n, p in trial.params.items()}
        trial.step({n: torch.zeros(s) for n, s in SHAPES.items()}, round=k)
        _close(offset, {n: trial.params[n] - before[n] for n in SHAPES})
        eager.observe(k, coordinator.step(delta, round=k))
    assert any(float(v.abs().max()) > 0 for v in offset.values())  # by the last round the momentum moves it


def test_a_missed_update_leaves_the_buffer_to_the_momentum() -> None:
    cfg = OuterConfig(name="SGD", lr=1.0, momentum=0.5, nesterov=False)
    eager = EagerStart(cfg, ROUNDS, weight=1.0)
    d0, d2 = _deltas(2)
    eager.offset(0, d0)
    eager.observe(0, {n: -v for n, v in d0.items()})  # buffer d0
    eager.missed(1)  # buffer 0.5·d0, no mean known
    assert eager.mean is None
    _close(eager.offset(2, d2), {n: -(0.25 * d0[n] + d2[n]) for n in SHAPES})


@pytest.mark.parametrize(
    "cfg, match",
    [
        (OuterConfig(name="Adam", lr=0.1), "needs outer.name=SGD .this run has outer.name=Adam"),
        (OuterConfig(name="DelayedNesterov", lr=0.7), "outer.name=DelayedNesterov"),
        (OuterConfig(name="SGD", lr=0.7, kwargs={"weight_decay": 0.1}), "outer.kwargs.weight_decay=0.1"),
        (OuterConfig(name="SGD", lr=0.7, kwargs={"dampening": 0.1}), "outer.kwargs.dampening=0.1"),
    ],
)
def test_an_outer_step_the_look_ahead_cannot_follow_is_refused_naming_it(cfg: OuterConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_eager_outer(cfg)
    with pytest.raises(ValueError, match=match):
        EagerStart(cfg, 3, weight=1.0)


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_a_weight_outside_zero_to_one_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match=f"eager weight={weight}"):
        EagerStart(OuterConfig(), 3, weight=weight)
