"""The defences against poisoned pushes: config checks, the norm bound, robust aggregates."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.outer import WeightedMean
from diloco.outer.robust import NormBound, RobustConfig, StackedAggregate, delta_norm, make_aggregate, robust_config, stacked_bytes

pytestmark = pytest.mark.timeout(60)

SHAPES = {"w": torch.Size([3, 4]), "b": torch.Size([5])}


def _random_pushes(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(n)]


def _aggregate(pushes: list[dict[str, torch.Tensor]], how: str, trim: float = 0.25, weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    acc = StackedAggregate(SHAPES, how, trim)
    for i, p in enumerate(pushes):
        acc.add(p, weights[i] if weights else 1.0)
    return acc.mean()


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("norm_ratio", 1.0, r"robust\.norm_ratio=1\.0: must be 0 \(off\) or a finite number > 1"),
        ("norm_ratio", -2.0, r"robust\.norm_ratio=-2\.0: must be"),
        ("norm_ratio", math.inf, r"robust\.norm_ratio=inf: must be"),
        ("norm_ratio", True, r"robust\.norm_ratio=True: must be"),
        ("action", "drop", r"robust\.action='drop': must be one of reject, clip"),
        ("window", 0, r"robust\.window=0: must be an integer >= 1"),
        ("window", 2.5, r"robust\.window=2\.5: must be an integer"),
        ("min_history", 0, r"robust\.min_history=0: must be an integer in \[1, robust\.window=16\]"),
        ("min_history", 17, r"robust\.min_history=17: must be"),
        ("trim", 0.5, r"robust\.trim=0\.5: must be a number in \[0, 0\.5\)"),
        ("trim", -0.1, r"robust\.trim=-0\.1: must be"),
    ],
)
def test_config_errors_name_the_field_and_value(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RobustConfig(**{field: value})


def test_config_defaults_are_off_and_ints_become_floats() -> None:
    cfg = RobustConfig()
    assert (cfg.norm_ratio, cfg.action) == (0.0, "reject")
    cfg = RobustConfig(norm_ratio=3, trim=0)
    assert isinstance(cfg.norm_ratio, float) and cfg.norm_ratio == 3.0
    assert isinstance(cfg.trim, float)


def test_robust_config_from_a_mapping_names_unknown_keys() -> None:
    assert robust_config(None) == RobustConfig()
    assert robust_config({"norm_ratio": 4.0, "action": "clip"}) == RobustConfig(norm_ratio=4.0, action="clip")
    with pytest.raises(ValueError, match=r"unknown robust key\(s\) ratio, windw; known: action, min_history"):
        robust_config({"ratio": 2.0, "windw": 3})
    with pytest.raises(ValueError, match="robust: must be a mapping"):
        robust_config("median")  # type: ignore[arg-type]


# --- norm bound -----------------------------------------------------------------------------


def test_delta_norm_is_l2_over_all_tensors_and_inf_when_broken() -> None:
    assert delta_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}) == 5.0
    assert delta_norm({}) == 0.0
    big = torch.full((4,), 3e38)  # squares overflow float32, not float64
    assert delta_norm({"a": big}) == pytest.approx(6e38, rel=1e-6)
    assert delta_norm({"a": torch.tensor([1.0, float("nan")])}) == math.inf
    assert delta_norm({"a": torch.tensor([1.0]), "b": torch.tensor([-math.inf])}) == math.inf


def test_first_pushes_are_trusted_until_min_history() -> None:
    bound = NormBound(RobustConfig(norm_ratio=2.0, min_history=3))
    for norm in (1.0, 1000.0, 1.0):
        v = bound.judge(norm)
        assert (v.action, v.reference, v.scale) == ("take", None, 1.0)
        assert "trusted" in v.describe()
        bound.record(v.taken_norm)
    v = bound.judge(1000.0)  # now the median of (1, 1000, 1) = 1 is the reference
    assert (v.action, v.reference) == ("reject", 1.0)


def test_reject_gives_the_figures() -> None:
    bound = NormBound(RobustConfig(norm_ratio=3.0, min_history=3), history=[1.0, 2.0, 4.0])
    ok = bound.judge(6.0)  # limit 3 × 2 = 6, inclusive
    assert (ok.action, ok.reference, ok.scale) == ("take", 2.0, 1.0)
    v = bound.judge(6.5)
    assert (v.action, v.norm, v.reference, v.taken_norm) == ("reject", 6.5, 2.0, None)
    assert v.describe() == "rejected: norm 6.5 exceeds 3 × the median of recent norms 2"


def test_clip_scales_down_to_the_limit() -> None:
    bound = NormBound(RobustConfig(norm_ratio=2.0, action="clip", min_history=2), history=[1.0, 3.0])
    v = bound.judge(10.0)  # reference median(1, 3) = 2, limit 4
    assert (v.action, v.reference) == ("clip", 2.0)
    assert v.scale == pytest.approx(0.4)
    assert v.taken_norm == pytest.approx(4.0)
    assert v.describe() == "clipped: norm 10 exceeds 2 × the median of recent norms 2; Δ scaled by 0.4"
    bound.record(v.taken_norm)  # the clipped norm counts
    assert bound.history == [1.0, 3.0, pytest.approx(4.0)]


@pytest.mark.parametrize("cfg", [RobustConfig(), RobustConfig(norm_ratio=2.0, action="clip"), RobustConfig(norm_ratio=2.0, min_history=16)])
@pytest.mark.parametrize("norm", [math.inf, math.nan])
def test_non_finite_norm_is_always_rejected(cfg: RobustConfig, norm: float) -> None:
    v = NormBound(cfg).judge(norm)
    assert v.action == "reject" and v.taken_norm is None
    assert "NaN or infinite" in v.describe()
    with pytest.raises(ValueError, match="finite"):
        NormBound(cfg).record(norm)


def test_bound_off_takes_any_finite_norm() -> None:
    bound = NormBound(RobustConfig(norm_ratio=0.0, min_history=1), history=[1.0])
    v = bound.judge(1e30)
    assert (v.action, v.reference) == ("take", 1.0)
    assert "off" in v.describe()


def test_history_keeps_only_the_window() -> None:
    cfg = RobustConfig(norm_ratio=2.0, window=3, min_history=3)
    bound = NormBound(cfg, history=[100.0, 100.0, 100.0, 100.0])
    assert bound.history == [100.0, 100.0, 100.0]
    for _ in range(2):
        bound.record(1.0)
    assert bound.history == [100.0, 1.0, 1.0]
    assert bound.reference() == 1.0  # the old large norms have left the median
    assert bound.judge(50.0).action == "reject"
    restored = NormBound(cfg, bound.history)
    assert restored.history == bound.history and restored.judge(50.0) == bound.judge(50.0)


def test_median_of_an_even_window_is_the_mean_of_the_middle_two() -> None:
    bound = NormBound(RobustConfig(norm_ratio=2.0, window=4, min_history=4), history=[1.0, 2.0, 4.0, 100.0])
    assert bound.reference() == 3.0


# --- robust aggregates ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_median_matches_torch_quantile(n: int) -> None:
    pushes = _random_pushes(n, seed=n)
    got = _aggregate(pushes, "median", weights=[float(i + 1) for i in range(n)])  # weights are ignored
    for name in SHAPES:
        want = torch.quantile(torch.stack([p[name] for p in pushes]).double(), 0.5, dim=0)
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want.float(), rtol=0, atol=1e-7)


@pytest.mark.parametrize(("n", "trim"), [(4, 0.25), (7, 0.2), (10, 0.1), (5, 0.0)])
def test_trimmed_mean_matches_a_direct_computation(n: int, trim: float) -> None:
    pushes = _random_pushes(n, seed=100 + n)
    got = _aggregate(pushes, "trimmed_mean", trim)
    k = math.floor(trim * n)
    for name, shape in SHAPES.items():
        stacked = torch.stack([p[name] for p in pushes]).reshape(n, -1)
        want = [sum(sorted(stacked[:, j].tolist())[k : n - k]) / (n - 2 * k) for j in range(stacked.shape[1])]
        torch.testing.assert_close(got[name], torch.tensor(want).reshape(shape), rtol=0, atol=1e-6)


def test_trim_zero_is_the_unweighted_mean() -> None:
    pushes = _random_pushes(5, seed=7)
    got = _aggregate(pushes, "trimmed_mean", 0.0, weights=[1.0, 1.0, 1.0, 1.0, 1e6])
    plain = WeightedMean(SHAPES)
    for p in pushes:
        plain.add(p, 1.0)
    for name, want in plain.mean().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("how", "n"), [("median", 6), ("median", 7), ("trimmed_mean", 8), ("trimmed_mean", 9)])
def test_any_push_order_gives_the_same_bits(how: str, n: int) -> None:
    pushes = _random_pushes(n, seed=n)
    first = _aggregate(pushes, how, 0.2)
    rng = random.Random(n)
    for _ in range(5):
        shuffled = pushes[:]
        rng.shuffle(shuffled)
        again = _aggregate(shuffled, how, 0.2)
        for name in SHAPES:
            assert torch.equal(again[name], first[name])


def test_signed_zeros_do_not_depend_on_order() -> None:
    a = {"w": torch.tensor([-0.0])}
    b = {"w": torch.tensor([0.0])}
    for order in ([a, b, a], [b, a, a], [a, a, b]):
        acc = StackedAggregate({"w": torch.Size([1])}, "median")
        for p in order:
            acc.add(p, 1.0)
        assert math.copysign(1.0, float(acc.mean()["w"])) == 1.0


@pytest.mark.parametrize("how", ["median", "trimmed_mean"])
def test_one_poisoned_push_among_four_moves_little(how: str) -> None:
    honest = _random_pushes(3, seed=3)
    poison = {k: torch.full(s, 1e30) for k, s in SHAPES.items()}
    got = _aggregate([honest[0], poison, honest[1], honest[2]], how, 0.25, weights=[1.0, 1e9, 1.0, 1.0])
    for name in SHAPES:
        stacked = torch.stack([h[name] for h in honest])
        lo, hi = stacked.min(dim=0).values, stacked.max(dim=0).values
        assert torch.all(got[name] >= lo) and torch.all(got[name] <= hi)  # inside the honest range
    weighted = WeightedMean(SHAPES)
    for p, w in ((honest[0], 1.0), (poison, 1e9), (honest[1], 1.0), (honest[2], 1.0)):
        weighted.add(p, w)
    assert weighted.mean()["w"].abs().min() > 1e29  # what the defence prevents


def test_a_trim_that_would_cut_everything_falls_back_to_the_median() -> None:
    for n in (2, 3, 4, 5):
        pushes = _random_pushes(n, seed=40 + n)
        trimmed = _aggregate(pushes, "trimmed_mean", 0.49)
        median = _aggregate(pushes, "median")
        for name in SHAPES:
            assert torch.equal(trimmed[name], median[name])


def test_errors_like_weighted_mean() -> None:
    acc = StackedAggregate(SHAPES, "median")
    with pytest.raises(ValueError, match="no contributions"):
        acc.mean()
    push = _random_pushes(1, seed=0)[0]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="weight must be > 0"):
            acc.add(push, bad)
    with pytest.raises(ValueError, match=r"w: shape \(4, 3\), expected \(3, 4\)"):
        acc.add({"w": torch.zeros(4, 3), "b": torch.zeros(5)}, 1.0)
    assert acc.count == 0 and acc.total_weight == 0.0
    with pytest.raises(ValueError, match="how='mean'"):
        StackedAggregate(SHAPES, "mean")
    with pytest.raises(ValueError, match=r"trim=0\.5"):
        StackedAggregate(SHAPES, "trimmed_mean", 0.5)


def test_push_is_copied_and_weights_summed() -> None:
    acc = StackedAggregate({"w": torch.Size([2])}, "median")
    t = torch.tensor([1.0, 2.0])
    acc.add({"w": t}, 3.0)
    t.fill_(99.0)  # the caller may reuse its buffer
    acc.add({"w": torch.tensor([3.0, 4.0])}, 5.0)
    assert torch.equal(acc.mean()["w"], torch.tensor([2.0, 3.0]))
    assert (acc.count, acc.total_weight) == (2, 8.0)


def test_make_aggregate_picks_the_accumulator() -> None:
    assert isinstance(make_aggregate(SHAPES, "mean"), WeightedMean)
    assert isinstance(make_aggregate(SHAPES, "nonzero"), WeightedMean)
    acc = make_aggregate(SHAPES, "trimmed_mean", 0.1)
    assert isinstance(acc, StackedAggregate) and (acc.how, acc.trim) == ("trimmed_mean", 0.1)
    assert isinstance(make_aggregate(SHAPES, "median"), StackedAggregate)
    with pytest.raises(ValueError, match="aggregate='sum': must be one of mean, nonzero, trimmed_mean, median"):
        make_aggregate(SHAPES, "sum")


def test_stacked_bytes() -> None:
    assert stacked_bytes(1_000_000, 8) == 32_000_000
    with pytest.raises(ValueError, match="must be integers >= 0"):
        stacked_bytes(-1, 2)


# --- properties -----------------------------------------------------------------------------

_values = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(deadline=None, max_examples=50)
@given(columns=st.lists(st.lists(_values, min_size=3, max_size=3), min_size=1, max_size=9), trim=st.floats(0.0, 0.49), seed=st.integers(0, 2**16))
def test_property_robust_aggregate_is_order_free_and_within_range(columns: list[list[float]], trim: float, seed: int) -> None:
    pushes = [{"w": torch.tensor(c, dtype=torch.float32)} for c in columns]
    shuffled = pushes[:]
    random.Random(seed).shuffle(shuffled)
    for how in ("median", "trimmed_mean"):
        results = []
        for order in (pushes, shuffled):
            acc = StackedAggregate({"w": torch.Size([3])}, how, trim)
            for p in order:
                acc.add(p, 1.0)
            results.append(acc.mean()["w"])
        assert torch.equal(results[0], results[1])
        stacked = torch.stack([p["w"] for p in pushes])
        assert torch.all(results[0] >= stacked.min(dim=0).values) and torch.all(results[0] <= stacked.max(dim=0).values)


@settings(deadline=None, max_examples=50)
@given(norms=st.lists(st.floats(0.0, 1e6, allow_subnormal=False), min_size=0, max_size=20), push=st.floats(0.0, 1e7), ratio=st.floats(1.01, 100.0))
def test_property_clip_never_exceeds_the_limit(norms: list[float], push: float, ratio: float) -> None:
    bound = NormBound(RobustConfig(norm_ratio=ratio, action="clip", window=8, min_history=2), norms)
    v = bound.judge(push)
    assert v.action in ("take", "clip")
    if v.reference is not None:
        assert v.taken_norm <= ratio * v.reference * (1 + 1e-12)
    if v.action == "take":
        assert v.scale == 1.0 and v.taken_norm == push
