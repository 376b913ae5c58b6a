"""The outer loop's math against values computed by hand, with no network."""

import io

import pytest
import torch

from diloco.outer import OuterConfig, OuterOptimizer, WeightedMean, apply_update, params_sha256, pseudo_gradient

pytestmark = pytest.mark.timeout(30)


def _inner_sgd(theta: float, grad: float, lr: float, steps: int) -> float:
    for _ in range(steps):
        theta -= lr * grad
    return theta


def test_pseudo_gradient_points_from_local_back_to_global() -> None:
    g = {"w": torch.tensor([1.0, 2.0])}
    local = {"w": torch.tensor([0.5, 2.5])}
    delta = pseudo_gradient(g, local)
    assert torch.equal(delta["w"], torch.tensor([0.5, -0.5]))  # θ − θ_local, not the reverse


def test_two_rounds_two_sites_nesterov_trace_by_hand() -> None:
    # θ0 = 1. Site A: constant gradient 1, site B: constant gradient 3; inner SGD lr 0.1, H = 2.
    # Weights (tokens) 100 and 300. Outer: torch SGD, lr 0.7, momentum 0.9, Nesterov.
    #   round 1: θ_A = 0.8, θ_B = 0.4 → Δ_A = 0.2, Δ_B = 0.6 → Δ = (0.2·100 + 0.6·300)/400 = 0.5
    #            buf = 0.5; step = Δ + 0.9·buf = 0.95; θ1 = 1 − 0.7·0.95 = 0.335
    #   round 2: Δ = 0.5 again; buf = 0.9·0.5 + 0.5 = 0.95; step = 0.5 + 0.9·0.95 = 1.355
    #            θ2 = 0.335 − 0.7·1.355 = −0.6135
    outer = OuterOptimizer({"w": torch.tensor([1.0])}, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    expected = [0.335, -0.6135]
    for r in range(2):
        theta = float(outer.params["w"])
        acc = WeightedMean({"w": torch.Size([1])})
        for grad, tokens in ((1.0, 100), (3.0, 300)):
            local = {"w": torch.tensor([_inner_sgd(theta, grad, 0.1, 2)])}
            acc.add(pseudo_gradient(outer.params, local), tokens)
        assert float(acc.mean()["w"]) == pytest.approx(0.5, abs=1e-6)
        update = outer.step(acc.mean())
        assert float(outer.params["w"]) == pytest.approx(expected[r], abs=1e-6)
        assert float(update["w"]) == pytest.approx(expected[r] - theta, abs=1e-6)


def test_outer_sgd_lr1_no_momentum_lands_on_the_mean_local_params() -> None:
    theta = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    outer = OuterOptimizer(theta, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    local = {n: t + 0.01 * torch.randn_like(t) for n, t in theta.items()}
    outer.step(pseudo_gradient(theta, local))
    for n in theta:
        torch.testing.assert_close(outer.params[n], local[n], rtol=0, atol=1e-6)


def test_site_copy_stays_bit_identical_to_the_coordinator() -> None:
    torch.manual_seed(0)
    theta = {"a": torch.randn(64, 33), "b": torch.randn(129)}
    outer = OuterOptimizer(theta, OuterConfig())
    site_copy = {n: t.clone() for n, t in theta.items()}
    for _ in range(5):
        delta = {n: 1e-3 * torch.randn_like(t) for n, t in theta.items()}
        update = outer.step(delta)
        apply_update(site_copy, update)
        assert params_sha256(site_copy) == params_sha256(outer.params)


def test_weighted_mean_uses_token_weights_and_rejects_bad_weights() -> None:
    acc = WeightedMean({"x": torch.Size([2])})
    acc.add({"x": torch.tensor([1.0, 0.0])}, 1)
    acc.add({"x": torch.tensor([0.0, 4.0])}, 3)
    torch.testing.assert_close(acc.mean()["x"], torch.tensor([0.25, 3.0]))
    with pytest.raises(ValueError, match="weight"):
        acc.add({"x": torch.zeros(2)}, 0)
    with pytest.raises(ValueError, match="no contributions"):
        WeightedMean({"x": torch.Size([2])}).mean()


def test_outer_optimizer_by_name_and_bad_names() -> None:
    outer = OuterOptimizer({"w": torch.ones(3)}, OuterConfig(name="Adam", lr=0.1, kwargs={"betas": (0.9, 0.99)}))
    outer.step({"w": torch.ones(3)})
    assert torch.all(outer.params["w"] < 1.0)  # a positive pseudo-gradient moves θ down
    with pytest.raises(ValueError, match="outer.name"):
        OuterConfig(name="NoSuchOptimizer")
    with pytest.raises(ValueError, match="outer.lr"):
        OuterConfig(lr=0.0)


def test_params_sha256_depends_on_names_values_and_shapes() -> None:
    a = {"w": torch.zeros(2, 3)}
    assert params_sha256(a) == params_sha256({"w": torch.zeros(2, 3)})
    assert params_sha256(a) != params_sha256({"w": torch.zeros(3, 2)})
    assert params_sha256(a) != params_sha256({"v": torch.zeros(2, 3)})
    b = {"w": torch.zeros(2, 3)}
    b["w"][1, 2] = 1e-30
    assert params_sha256(a) != params_sha256(b)


@pytest.mark.parametrize("aggregate", ["mean", "nonzero"])
def test_weighted_mean_does_not_depend_on_the_order_of_arrival(aggregate: str) -> None:
    g = torch.Generator().manual_seed(3)
    deltas = [{"x": torch.randn(200_000, generator=g) * 10.0 ** float(torch.randint(-4, 2, (1,), generator=g))} for _ in range(6)]
    for d in deltas:  # sparse, as a top-k codec leaves them: each site sends a different 5%
        d["x"][torch.rand(200_000, generator=g) > 0.05] = 0.0
    weights = [4096, 8192, 4096, 12288, 2048, 4096]
    results = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 3, 4]):
        acc = WeightedMean({"x": torch.Size([200_000])}, aggregate)
        for i in order:
            acc.add(deltas[i], weights[i])
        results.append(acc.mean()["x"])
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_nonzero_mean_averages_each_coordinate_over_the_sites_that_sent_it() -> None:
    # Site A (100 tokens) sent coordinates 0 and 1, site B (300 tokens) sent 1 and 2; nobody sent 3.
    acc = WeightedMean({"x": torch.Size([4])}, "nonzero")
    acc.add({"x": torch.tensor([2.0, 1.0, 0.0, 0.0])}, 100)
    acc.add({"x": torch.tensor([0.0, 3.0, -4.0, 0.0])}, 300)
    assert acc.mean()["x"].tolist() == [2.0, (1.0 * 100 + 3.0 * 300) / 400, -4.0, 0.0]
    plain = WeightedMean({"x": torch.Size([4])})  # the plain mean divides every coordinate by 400
    plain.add({"x": torch.tensor([2.0, 1.0, 0.0, 0.0])}, 100)
    plain.add({"x": torch.tensor([0.0, 3.0, -4.0, 0.0])}, 300)
    assert plain.mean()["x"].tolist() == [0.5, 2.5, -3.0, 0.0]


def test_nonzero_mean_of_dense_deltas_is_the_mean() -> None:
    g = torch.Generator().manual_seed(5)
    deltas = [{"x": torch.randn(1000, generator=g)} for _ in range(3)]
    accs = [WeightedMean({"x": torch.Size([1000])}, a) for a in ("mean", "nonzero")]
    for acc in accs:
        for d, w in zip(deltas, (100, 200, 700)):
            acc.add(d, w)
    assert torch.equal(accs[0].mean()["x"], accs[1].mean()["x"])


def test_unknown_aggregate_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="aggregate='median'.*mean, nonzero"):
        WeightedMean({"x": torch.Size([1])}, "median")


def _run_outer(cfg: OuterConfig, grads: list[torch.Tensor], start: torch.Tensor) -> OuterOptimizer:
    outer = OuterOptimizer({"w": start}, cfg)
    for g in grads:
        outer.step({"w": g})
    return outer


def test_delayed_nesterov_period_1_is_bit_identical_to_nesterov_sgd() -> None:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) * 0.1 for _ in range(7)]
    sgd = _run_outer(OuterConfig(), grads, start)
    dn = _run_outer(OuterConfig(name="DelayedNesterov", period=1), grads, start)
    assert torch.equal(sgd.params["w"], dn.params["w"])


def test_delayed_nesterov_moves_by_one_nesterov_step_on_the_mean_every_period() -> None:
    lr, beta = 0.7, 0.9
    g = [torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5]), torch.tensor([-1.0, 4.0])]
    h = [torch.tensor([0.5, 0.5]), torch.tensor([2.0, -1.0]), torch.tensor([0.0, 3.0])]
    start = torch.tensor([10.0, 20.0])
    outer = OuterOptimizer({"w": start}, OuterConfig(name="DelayedNesterov", lr=lr, momentum=beta, period=3))
    outer.step({"w": g[0]})
    # between momentum updates: plain descent with lr / period, no momentum
    torch.testing.assert_close(outer.params["w"], start - lr * g[0] / 3)
    outer.step({"w": g[1]})
    outer.step({"w": g[2]})
    mean_g = sum(g) / 3
    after_g = start - lr * (mean_g + beta * mean_g)  # m = mean_g
    torch.testing.assert_close(outer.params["w"], after_g)
    for x in h:
        outer.step({"w": x})
    mean_h = sum(h) / 3
    m = beta * mean_g + mean_h
    torch.testing.assert_close(outer.params["w"], after_g - lr * (mean_h + beta * m))


def test_delayed_nesterov_state_survives_a_checkpoint_mid_period() -> None:
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(50, generator=gen)
    grads = [torch.randn(50, generator=gen) for _ in range(9)]
    cfg = OuterConfig(name="DelayedNesterov", period=4)
    whole = _run_outer(cfg, grads, start)
    first = _run_outer(cfg, grads[:6], start)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # as the coordinator's checkpoint does
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    second = OuterOptimizer({"w": torch.zeros(50)}, cfg)
    second.load_state_dict(state)
    for x in grads[6:]:
        second.step({"w": x})
    assert torch.equal(whole.params["w"], second.params["w"])


def test_delayed_nesterov_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="outer.period"):
        OuterConfig(name="DelayedNesterov", period=0)
    with pytest.raises(ValueError, match="outer.momentum"):
        OuterConfig(name="DelayedNesterov", momentum=1.0)
