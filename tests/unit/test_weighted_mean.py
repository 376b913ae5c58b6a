"""The outer step's weighted mean (diloco.outer.WeightedMean): accumulated in float64 without a
float64 copy of each push, bit for bit what the float64 copy gave, for both aggregates; a mean
of nothing refused."""

from __future__ import annotations

import pytest
import torch
from helpers import generator as _g

from diloco.outer import WeightedMean

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("aggregate", ["mean", "nonzero"])
def test_the_weighted_mean_is_bit_for_bit_the_one_with_a_float64_copy(aggregate: str) -> None:
    g = _g()
    shapes = {"a": torch.Size([1001, 7]), "b": torch.Size([13])}
    acc = WeightedMean(shapes, aggregate)
    ref_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    ref_w = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    total = 0.0
    for weight in (4096.0, 123457.0, 3.0, 2.0**29 - 1):
        delta = {n: torch.randn(s, generator=g) * 10.0 ** torch.randint(-12, 12, s, generator=g).float() for n, s in shapes.items()}
        delta["a"][0, :3] = 0.0
        acc.add(delta, weight)
        for n in shapes:
            ref_sum[n].add_(delta[n].double(), alpha=weight)
            ref_w[n].add_(delta[n] != 0, alpha=weight)
        total += weight
    mean = acc.mean()
    for n in shapes:
        divisor = total if aggregate == "mean" else torch.where(ref_w[n] > 0, ref_w[n], 1.0)
        assert torch.equal(mean[n], (ref_sum[n] / divisor).float())


def test_a_mean_of_nothing_is_refused_and_buffers_wait_for_the_first_push() -> None:
    acc = WeightedMean({"w": torch.Size([4])})
    with pytest.raises(ValueError, match="no contributions"):
        acc.mean()
    acc.add({"w": torch.ones(4)}, 2.0)
    assert torch.equal(acc.mean()["w"], torch.ones(4))
