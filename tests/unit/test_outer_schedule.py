"""The outer schedules (diloco.outer.schedule): their values by outer step against tables
computed by hand, the outer step they drive, a restore in the middle of a warm-up, and the
fields a run refuses, named."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig, OuterOptimizer, OuterSchedule, averaged_from
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint


def test_lr_warmup_then_cosine_decay_by_hand() -> None:
    s = OuterSchedule(lr_warmup=2, lr_decay="cosine", lr_min_ratio=0.1)
    # Warm-up: 0.8·1/2, 0.8·2/2; then q = (k−2)/4 for k = 2..5; low = 0.08.
    c = [0.5 * (1 + math.cos(math.pi * q)) for q in (0.0, 0.25, 0.5, 0.75)]
    expected = [0.4, 0.8] + [0.08 + 0.72 * d for d in c]
    assert [s.lr(0.8, k, 6) for k in range(6)] == pytest.approx(expected, abs=1e-12)
    assert expected[2:] == pytest.approx([0.8, 0.6945584, 0.44, 0.1854416], abs=1e-7)


def test_linear_decay_and_momentum_warmup_by_hand() -> None:
    s = OuterSchedule(lr_decay="linear", momentum_warmup=3)
    assert [s.lr(1.0, k, 4) for k in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])  # the last step still moves θ
    assert [s.momentum(0.9, k) for k in range(5)] == pytest.approx([0.0, 0.3, 0.6, 0.9, 0.9])
    none = OuterSchedule()
    assert not none.active and [none.lr(0.7, k, 3) for k in range(3)] == [0.7] * 3 and none.momentum(0.9, 0) == 0.9


def test_the_schedule_drives_nesterov_sgd_as_computed_by_hand() -> None:
    # θ0 = 0, the mean Δ is 1 every round; lr 0.7 warmed up over 2 steps, momentum 0.9 over 2.
    outer = OuterOptimizer({"w": torch.zeros(1)}, OuterConfig(lr_warmup=2, momentum_warmup=2), steps=3)
    got = []
    for r in range(3):
        outer.step({"w": torch.ones(1)}, round=r)
        got.append(float(outer.params["w"]))
    # k=0: lr 0.35, m 0: θ −= 0.35.
    # k=1: lr 0.7, m 0.45: buf = g = 1 (torch starts it at the first step with momentum); nesterov g + m·buf = 1.45; θ −= 1.015.
    # k=2: lr 0.7, m 0.9: buf = 0.9·1 + 1 = 1.9; g + 0.9·1.9 = 2.71; θ −= 1.897.
    assert got == pytest.approx([-0.35, -1.365, -3.262], abs=1e-6)
    assert outer.hyperparameters(2) == {"lr": 0.7, "momentum": 0.9}


def test_fragments_step_on_their_own_rounds() -> None:
    outer = OuterOptimizer({"w": torch.zeros(1)}, OuterConfig(lr_warmup=3), steps=4, fragments=2)
    # Rounds 0 and 1 are outer step 0 of fragments 0 and 1; rounds 2 and 3 step 1; ...
    assert [outer.hyperparameters(r)["lr"] for r in range(6)] == pytest.approx([0.7 / 3] * 2 + [1.4 / 3] * 2 + [0.7] * 2)


def test_flush_rounds_average_into_theta_without_the_outer_step() -> None:
    # F = 2 (w: rounds 0, 2, 4; v: rounds 1, 3), round 4 a flush round; heavy ball lr 0.5,
    # momentum 0.9, the mean Δ is 1 every round. w: buf 1, w = −0.5; buf 1.9, w = −1.45; then
    # the flush averages: w = −1.45 − 1 = −2.45, its buffer left at 1.9 (an outer step would
    # have moved w by 0.5·(0.9·1.9 + 1) = 1.355 and the buffer to 2.71).
    outer = OuterOptimizer({"w": torch.zeros(1), "v": torch.zeros(1)}, OuterConfig(lr=0.5, momentum=0.9, nesterov=False), steps=3, fragments=2, average_from=4)
    for r, name in enumerate(["w", "v", "w", "v", "w"]):
        update = outer.step({name: torch.ones(1)}, round=r)
    assert float(update["w"]) == -1.0 and float(outer.params["w"]) == pytest.approx(-2.45)
    assert float(outer._opt.state[outer.params["w"]]["momentum_buffer"]) == pytest.approx(1.9)
    assert float(outer.params["v"]) == pytest.approx(-1.45)


@pytest.mark.parametrize("fragments, flush, frozen", [(1, 0, False), (2, 1, False), (2, 0, True)])
def test_final_average_ends_each_parameter_on_an_average(fragments: int, flush: int, frozen: bool) -> None:
    # Heavy ball lr 0.5, momentum 0.9, one site pushing Δ = 1 each round, 3 outer steps per
    # parameter. Blocking: w = −0.5 (buf 1), −1.45 (buf 1.9), then the last round averages:
    # −2.45 (a step would have made it −1.45 − 0.5·2.71 = −2.805). Two fragments (rounds
    # w v w v w v, then a flush round for w): v's third round is the last of training and
    # averages; w's third is a step (−2.805), and its flush round averages after it. Frozen
    # fragments (no flush round): each fragment's third round is its last, and both average.
    cfg = OuterConfig(lr=0.5, momentum=0.9, nesterov=False, final_average=True)
    w, v = "blocks.0.w", "blocks.1.w"  # numbered layers: fragments=2 puts one in each
    theta = {w: torch.zeros(1), v: torch.zeros(1)}
    trained = 3 * fragments
    coord = Coordinator(theta, cfg, CoordinatorConfig(total_rounds=trained + flush, fragments=fragments, flush_rounds=flush, frozen_end=frozen))
    coord.join(JoinRequest("a", tuple(fingerprint(theta).values())))
    names = [[w, v]] * 3 if fragments == 1 else [[w], [v]] * 3 + [[w]] * flush
    for r, pushed in enumerate(names):
        delta = {n: torch.ones(1) for n in pushed}
        coord.push(PushHeader(site_id="a", round=r, tokens=1, train_loss=1.0, inner_steps=1), encode_chunks(delta, codec=get_codec("fp32")))
    final = coord.global_params()
    assert float(final[v]) == pytest.approx(-2.45)
    assert float(final[w]) == pytest.approx(-2.805 - 1 if flush else -2.45)
    assert OuterOptimizer(theta, cfg).average_from is None  # the optimizer alone: told by the coordinator


def test_averaged_from_counts_the_last_rounds_of_training() -> None:
    assert averaged_from(10, 0, True) == 9 and averaged_from(10, 0, False) is None
    assert averaged_from(14, 4, True) == 9 and averaged_from(14, 4, False) == 10  # flush rounds
    assert averaged_from(10, 0, True, last=5) == 5  # frozen fragments: each one's last round
    with pytest.raises(ValueError, match="frozen_end=True"):
        CoordinatorConfig(total_rounds=10, fragments=1, frozen_end=True)
    with pytest.raises(ValueError, match="frozen_end"):
        CoordinatorConfig(total_rounds=10, fragments=2, flush_rounds=1, frozen_end=True)


def test_final_average_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="outer.final_average='yes'"):
        OuterConfig(final_average="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["SGD", "DelayedNesterov"])
def test_a_restore_mid_warmup_goes_on_bit_identically(name: str) -> None:
    cfg = OuterConfig(name=name, period=2, lr_warmup=3, lr_decay="cosine", momentum_warmup=4)
    g = torch.Generator().manual_seed(7)
    theta = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    deltas = [{n: torch.randn(t.shape, generator=g) * 0.1 for n, t in theta.items()} for _ in range(8)]
    straight = OuterOptimizer(theta, cfg, steps=8)
    for r, d in enumerate(deltas):
        straight.step(d, round=r)
    first = OuterOptimizer(theta, cfg, steps=8)
    for r, d in enumerate(deltas[:3]):
        first.step(d, round=r)
    second = OuterOptimizer(theta, cfg, steps=8)  # a new process: its groups hold the base lr and momentum
    second.load_state_dict(first.state_dict())
    for r, d in enumerate(deltas[3:], start=3):
        second.step(d, round=r)
    assert all(torch.equal(straight.params[n], second.params[n]) for n in theta)


def test_a_schedule_needs_the_runs_length_and_each_steps_round() -> None:
    with pytest.raises(ValueError, match="number of outer steps"):
        OuterOptimizer({"w": torch.zeros(1)}, OuterConfig(lr_warmup=2))
    outer = OuterOptimizer({"w": torch.zeros(1)}, OuterConfig(lr_warmup=2), steps=3)
    with pytest.raises(ValueError, match="needs its round"):
        outer.step({"w": torch.ones(1)})
    assert float(outer.params["w"]) == 0.0


@pytest.mark.parametrize(
    ("outer", "says"),
    [
        ({"lr_warmup": -1}, "outer.lr_warmup=-1: must be an integer >= 0"),
        ({"momentum_warmup": 1.5}, "outer.momentum_warmup=1.5: must be an integer >= 0"),
        ({"lr_decay": "exp"}, "outer.lr_decay='exp': must be one of none, linear, cosine"),
        ({"lr_min_ratio": 2}, r"outer.lr_min_ratio=2: must be a number in \[0, 1\]"),
        ({"lr": float("inf")}, "outer.lr=inf: must be a finite number > 0"),
        ({"lr": float("nan")}, "outer.lr=nan: must be a finite number > 0"),
        ({"lr": -0.1}, "outer.lr=-0.1: must be a finite number > 0"),
        ({"momentum": -0.5}, "outer.momentum=-0.5: must be a finite number >= 0"),
        ({"name": "Adam", "lr": 0.1, "momentum_warmup": 2}, "outer.momentum_warmup=2: only for SGD and DelayedNesterov"),
        ({"lr_warmup": 11}, "outer.lr_warmup=11: longer than the run's 10 outer steps"),
        ({"momentum_warmup": 12}, "outer.momentum_warmup=12: longer than the run's 10 outer steps"),
    ],
)
def test_bad_schedules_are_refused_before_any_process_naming_the_field(outer: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        run_config_from_dict({"rounds": 10, "outer": outer})


def test_a_warmup_as_long_as_the_run_is_fine() -> None:
    cfg = run_config_from_dict({"rounds": 10, "outer": {"lr_warmup": 10, "momentum_warmup": 10, "lr_decay": "linear"}})
    assert cfg.outer_step.schedule == OuterSchedule(lr_warmup=10, lr_decay="linear", momentum_warmup=10)
