"""No input can break a commit: an outer step that would make θ non-finite or absurd leaves
θ, the optimizer state and the downlink residual as they were; a coordinator whose ticker or
checkpoint write fails says so and refuses every call instead of serving a wedged run."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import coordinator, filled, push

from diloco.coordinator import CoordinatorConfig
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, OuterOptimizer, OuterStepRefused

pytestmark = pytest.mark.timeout(60)
THETA = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.ones(4)}


def _state(outer: OuterOptimizer) -> list[torch.Tensor]:
    s = outer.state_dict()
    return [*s["params"].values(), *(t for st in s["optimizer"]["state"].values() for t in st.values() if isinstance(t, torch.Tensor))]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38, 1e30])
def test_a_refused_outer_step_leaves_theta_and_momentum_as_they_were(value: float) -> None:
    outer = OuterOptimizer(THETA, OuterConfig())
    outer.step({n: torch.full_like(p, 0.01) for n, p in outer.params.items()})  # momentum exists now
    before = [t.clone() for t in _state(outer)]
    with pytest.raises(OuterStepRefused):
        outer.step({n: torch.full_like(p, value) for n, p in outer.params.items()})
    after = _state(outer)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    outer.step({n: torch.full_like(p, 0.01) for n, p in outer.params.items()})  # and it steps on


def test_a_transmit_that_raises_refuses_the_step() -> None:
    outer = OuterOptimizer(THETA, OuterConfig())
    before = {n: p.clone() for n, p in outer.params.items()}

    def broken(_u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("encoder broke")

    with pytest.raises(OuterStepRefused, match="encoder broke"):
        outer.step({n: torch.full_like(p, 0.01) for n, p in outer.params.items()}, transmit=broken)
    assert all(torch.equal(outer.params[n], before[n]) for n in before)


def test_a_round_whose_step_would_overflow_is_rejected_and_the_residual_stays() -> None:
    coord = coordinator(THETA, CoordinatorConfig(total_rounds=3, codec_down="int8"), sites=("a",))
    records = []
    coord.on_commit.append(records.append)
    push(coord, "a", 0, filled(THETA, 0.01))
    residual = coord.shard.parts[0].encoder.feedback.residual  # noqa: SLF001 - the state the refusal must not move
    theta = coord.global_params()
    push(coord, "a", 1, filled(THETA, 3e38), tokens=2**40)
    assert records[1].rejected and records[1].guard
    assert coord.shard.parts[0].encoder.feedback.residual is residual  # noqa: SLF001
    assert all(torch.equal(theta[n], p) for n, p in coord.global_params().items())
    push(coord, "a", 2, filled(THETA, 0.01))
    assert not records[2].rejected and coord.finished


def test_a_ticker_that_breaks_fails_the_coordinator_loudly() -> None:
    coord = coordinator(THETA, CoordinatorConfig(total_rounds=2))
    failures: list[str] = []
    seen = threading.Event()
    coord.on_fatal.append(lambda what, e: (failures.append(f"{what}: {e}"), seen.set()))

    def broken_tick() -> None:
        raise RuntimeError("boom")

    coord.tick = broken_tick  # type: ignore[method-assign]
    stop = coord.start_ticker(0.01)
    try:
        assert seen.wait(5)
    finally:
        stop()
    assert failures == ["the ticker: boom"]
    with pytest.raises(CoordinatorError) as info:
        coord.heartbeat("a")
    assert info.value.kind == "unavailable" and "the ticker failed: RuntimeError: boom" in info.value.message


def test_a_checkpoint_that_cannot_be_written_fails_the_coordinator_and_wakes_waiters(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    coord = coordinator(THETA, CoordinatorConfig(total_rounds=2, checkpoint_dir=str(blocker / "ckpt")), sites=("a",))
    fatal: list[str] = []
    coord.on_fatal.append(lambda what, e: fatal.append(what))
    with pytest.raises(CoordinatorError) as info:
        push(coord, "a", 0, filled(THETA, 0.01))
    assert info.value.kind == "unavailable" and fatal == ["the checkpoint of round 0"]
    with pytest.raises(CoordinatorError, match="must be restarted from its checkpoint"):
        coord.pull_global("a")  # does not wait forever for a publication that cannot come
