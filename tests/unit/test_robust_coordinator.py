"""robust.* inside the coordinator: a push far larger than the recent ones is refused (the
round goes on without it, the site is told) or clipped; a coordinate-wise median or trimmed
mean shrugs off one absurd push; everything survives a checkpoint."""

from __future__ import annotations

import pytest
import torch
from helpers import coordinator, filled, push

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, RobustConfig

pytestmark = pytest.mark.timeout(60)
THETA = {"w": torch.zeros(8)}
SGD = OuterConfig(name="SGD", lr=1.0, momentum=0.0, nesterov=False)


def _coord(robust: RobustConfig, sites: int = 4, rounds: int = 3, aggregate: str = "mean") -> Coordinator:
    cfg = CoordinatorConfig(total_rounds=rounds, min_sites=sites, robust=robust, aggregate=aggregate)
    return coordinator(THETA, cfg, outer=SGD, sites=tuple(str(s) for s in range(sites)))


def test_a_push_far_above_the_recent_norms_is_refused_and_the_round_goes_on() -> None:
    c = _coord(RobustConfig(norm_ratio=3, min_history=2))
    records = []
    c.on_commit.append(records.append)
    for s in range(3):
        assert not push(c, str(s), 0, filled(THETA, 0.1)).refused
    result = push(c, "3", 0, filled(THETA, 10.0))
    assert result.accepted and "exceeds 3 ×" in result.refused
    (refused,) = records[0].refused
    assert refused["site"] == "3" and refused["norm"] == pytest.approx(10.0 * 8**0.5)
    assert records[0].tokens == 30  # only the counted pushes
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -0.1))  # SGD lr 1: θ − mean of the counted
    assert c.refusals() == {"3": 1}


def test_clip_scales_the_push_down_to_the_bound() -> None:
    c = _coord(RobustConfig(norm_ratio=2, min_history=2, action="clip"))
    records = []
    c.on_commit.append(records.append)
    for s in range(3):
        push(c, str(s), 0, filled(THETA, 0.1))
    assert "clip" in push(c, "3", 0, filled(THETA, 10.0)).clipped
    (clipped,) = records[0].clipped
    assert clipped["scale"] == pytest.approx(0.02)  # to 2 × the median norm
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -(0.1 * 3 + 0.2) / 4))


@pytest.mark.parametrize("how", ["median", "trimmed_mean"])
def test_a_robust_aggregate_ignores_one_absurd_push(how: str) -> None:
    c = _coord(RobustConfig(trim=0.25), aggregate=how)
    for s, v in enumerate([0.1, 0.1, 0.1, 1e30]):
        push(c, str(s), 0, filled(THETA, v))
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -0.1))


def test_the_norm_history_and_refusals_survive_a_checkpoint() -> None:
    robust = RobustConfig(norm_ratio=3, min_history=2)
    c = _coord(robust)
    for s in range(3):
        push(c, str(s), 0, filled(THETA, 0.1))
    push(c, "3", 0, filled(THETA, 10.0))
    state = c._checkpoint_state()  # noqa: SLF001 - what a checkpoint holds
    restored = Coordinator(THETA, SGD, CoordinatorConfig(total_rounds=3, min_sites=4, robust=robust))
    restored.restore(state)
    assert restored.refusals() == {"3": 1}
    assert restored.intake.bound.history == c.intake.bound.history


def test_a_non_finite_push_is_refused_whole_with_the_bound_off() -> None:
    """The wire refuses non-finite values as it decodes, before any bound judges the push."""
    c = _coord(RobustConfig())
    for s in range(3):
        push(c, str(s), 0, filled(THETA, 0.1))
    with pytest.raises(CoordinatorError, match="non-finite values") as info:
        push(c, "3", 0, filled(THETA, float("nan")))
    assert info.value.kind == "invalid_argument" and c.committed_rounds == 0  # nothing of it counted
    push(c, "3", 0, filled(THETA, 0.1))
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -0.1))
