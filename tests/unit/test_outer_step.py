"""The outer step (diloco.outer.OuterOptimizer.step, check_update) against the slower one it
replaced: bit for bit the same θ, update and optimizer state, over fragments and refusals (all
or nothing still); a refused first step leaves no optimizer state; an absurd update is still
measured against θ."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import generator as _g

from diloco.outer import OuterConfig, OuterOptimizer, OuterStepRefused, check_update

pytestmark = pytest.mark.timeout(60)


class _Reference:
    """The outer step as it was before issue 16: a deepcopy of the state dict, norms measured
    as they come, θ restored and the update added."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: OuterConfig) -> None:
        self.names = sorted(params)
        self.params = {n: params[n].clone() for n in self.names}
        self.opt = cfg.build([self.params[n] for n in self.names])

    def step(self, mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = [n for n in self.names if n in mean]
        before = {n: self.params[n].clone() for n in names}
        saved = copy.deepcopy(self.opt.state_dict())
        for n in names:
            self.params[n].grad = mean[n].clone()
        self.opt.step()
        proposed = {}
        for n in names:
            proposed[n] = self.params[n] - before[n]
            self.params[n].grad = None
            self.params[n].copy_(before[n])
        size = math.sqrt(sum(float((t.double() ** 2).sum()) for t in proposed.values()))
        if not math.isfinite(size) or size > 100 * max(math.sqrt(sum(float((t.double() ** 2).sum()) for t in before.values())), 1.0):
            self.opt.load_state_dict(saved)
            raise OuterStepRefused("refused")
        for n in names:
            self.params[n].add_(proposed[n])
        return proposed


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize(
    "cfg",
    [
        OuterConfig(),
        OuterConfig(name="Adam", lr=0.01, kwargs={"betas": (0.9, 0.99)}),
        OuterConfig(name="DelayedNesterov", period=2),
        OuterConfig(momentum=0.0, nesterov=False),
    ],
    ids=["nesterov", "adam", "delayed", "sgd"],
)
def test_the_outer_step_is_bit_for_bit_the_old_one_fragments_and_refusals_included(cfg: OuterConfig) -> None:
    g = _g()
    theta = {"a": torch.randn(40, 8, generator=g), "b": torch.randn(8, generator=g), "c": torch.randn(3, 3, generator=g)}
    ours, ref = OuterOptimizer(theta, cfg), _Reference(theta, cfg)
    fragments = [("a", "b", "c"), ("a",), ("b", "c"), ("a", "b", "c"), ("c",), ("a", "b", "c")]
    for i, names in enumerate(fragments * 2):
        mean = {n: torch.randn(theta[n].shape, generator=g) * 0.01 for n in names}
        if i in (4, 9):  # refused: θ and the optimizer state stay, on both
            mean[names[0]][0] = float("inf")
            for o in (ours, ref):
                with pytest.raises(OuterStepRefused):
                    o.step(mean)
        else:
            u = ours.step(mean)
            v = ref.step(mean)
            assert all(torch.equal(u[n], v[n]) for n in names)
            assert ours.update_norm == math.sqrt(sum(float((t.double() ** 2).sum()) for t in v.values()))
        assert all(torch.equal(ours.params[n], ref.params[n]) for n in theta)
        a, b = _opt_tensors(ours._opt), _opt_tensors(ref.opt)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert ours._opt.state_dict()["param_groups"] == ref.opt.state_dict()["param_groups"]


def test_a_refused_first_step_leaves_no_optimizer_state() -> None:
    outer = OuterOptimizer({"w": torch.ones(3)}, OuterConfig(name="Adam", lr=0.1))

    def broken(_u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("encoder broke")

    with pytest.raises(OuterStepRefused, match="encoder broke"):
        outer.step({"w": torch.ones(3)}, transmit=broken)
    assert not outer._opt.state and torch.equal(outer.params["w"], torch.ones(3))


def test_an_absurd_update_is_still_measured_against_theta() -> None:
    theta = {"w": torch.full((4,), 1000.0)}  # |θ| = 2000: the limit is 200000
    assert check_update("u", {"w": torch.full((4,), 50.0)}, theta) == 100.0  # under 100: |θ| not needed
    assert check_update("u", {"w": torch.full((4,), 5000.0)}, theta) == 10000.0
    with pytest.raises(OuterStepRefused, match="over 100 x max"):
        check_update("u", {"w": torch.full((4,), 200000.0)}, theta)
    with pytest.raises(OuterStepRefused, match="over 100 x max"):
        check_update("u", {"w": torch.full((4,), 60.0)}, {"w": torch.zeros(4)})  # 120 > 100 x max(0, 1)
    with pytest.raises(OuterStepRefused, match="not finite"):
        check_update("u", {"w": torch.tensor([float("nan")])}, theta)
