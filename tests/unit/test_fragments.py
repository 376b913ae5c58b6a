"""The fragment split (strided over the layers, deterministic), the sync schedule's checks, and
the run config refusing what streaming, overlap and eager cannot do, naming the field."""

from __future__ import annotations

import pytest
import torch

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.model import build_model, model_config
from diloco.outer.fragments import describe, fragment_of_round, layer_of, split_fragments
from diloco.sync import SyncConfig, SyncSchedule


def _shapes(model_name: str = "tiny", **kw: int) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in build_model(model_config(model_name, **kw), 0).named_parameters()}


def test_layers_are_strided_over_the_fragments() -> None:
    shapes = _shapes(n_layers=4)
    split = split_fragments(shapes, 2)
    layers = [sorted({layer_of(n) for n in part} - {None}) for part in split]
    assert layers == [[0, 2], [1, 3]]
    assert sorted(n for part in split for n in part) == sorted(shapes)  # every name once
    assert split == split_fragments(dict(reversed(list(shapes.items()))), 2)  # the order of the names does not matter


def test_tensors_outside_the_layers_go_to_the_smallest_fragment() -> None:
    shapes = {"emb.weight": (100, 4), "blocks.0.w": (10,), "blocks.1.w": (20,), "norm.weight": (4,)}
    split = split_fragments(shapes, 2)
    # emb (400) first: fragment 0 (10) < fragment 1 (20); then norm (4) to fragment 1 (20 < 410).
    assert split == (("blocks.0.w", "emb.weight"), ("blocks.1.w", "norm.weight"))
    assert [d["numel"] for d in describe(split, shapes)] == [410, 24]


def test_hugging_face_names_carry_their_layer() -> None:
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == 12
    assert layer_of("transformer.h.3.attn.c_attn.bias") == 3
    assert layer_of("lm_head.weight") is None and layer_of("conv1.weight") is None


def test_one_fragment_is_every_name_and_round_r_syncs_r_mod_f() -> None:
    shapes = _shapes()
    assert split_fragments(shapes, 1) == (tuple(sorted(shapes)),)
    assert [fragment_of_round(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize(
    "fragments, why", [(0, "sync.fragments=0: must be an integer >= 1"), (4, "sync.fragments=4: the model has only 3 layer(s)"), (True, "sync.fragments=True")]
)
def test_bad_fragment_counts_are_refused(fragments: object, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        split_fragments(_shapes(), fragments)  # type: ignore[arg-type]


def test_balanced_fragments_are_equal_where_the_strided_ones_are_not() -> None:
    """8 layers in 5 fragments: strided gives three fragments of two layers and two of one;
    balanced gives each ~1/5 of the elements, within the largest tensor, from every layer."""
    shapes = _shapes("small")
    numel = {n: int(torch.tensor(s).prod()) for n, s in shapes.items()}
    strided = [d["numel"] for d in describe(split_fragments(shapes, 5), shapes)]
    assert strided == [1582080, 1582080, 1582080, 856576, 791296]
    split = split_fragments(shapes, 5, "balanced")
    sizes = [d["numel"] for d in describe(split, shapes)]
    assert sorted(n for part in split for n in part) == sorted(shapes)  # every name once
    assert sum(sizes) == sum(numel.values()) and max(sizes) - min(sizes) <= max(numel.values())
    assert max(sizes) / min(sizes) < 1.02
    assert all(len({layer_of(n) for n in part} - {None}) >= 6 for part in split)  # tensors of most layers
    assert split == split_fragments(dict(reversed(list(shapes.items()))), 5, "balanced")  # the order of the names does not matter


def test_balanced_fragments_by_hand() -> None:
    # largest first, each to the smallest fragment (ties: the lower fragment, then the layer order)
    shapes = {"blocks.0.a": (6,), "blocks.0.b": (5,), "blocks.1.a": (4,), "blocks.1.b": (3,), "emb": (2,)}
    assert split_fragments(shapes, 2, "balanced") == (("blocks.0.a", "blocks.1.b", "emb"), ("blocks.0.b", "blocks.1.a"))
    assert split_fragments(shapes, 1, "balanced") == (tuple(sorted(shapes)),)


@pytest.mark.parametrize(
    "fragments, how, why",
    [(6, "balanced", "sync.fragments=6: the model has only 5 tensor(s)"), (2, "random", "sync.split='random': must be one of strided, balanced")],
)
def test_bad_balanced_splits_are_refused(fragments: int, how: str, why: str) -> None:
    shapes = {"blocks.0.a": (6,), "blocks.0.b": (5,), "blocks.1.a": (4,), "blocks.1.b": (3,), "emb": (2,)}
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        split_fragments(shapes, fragments, how)


@pytest.mark.parametrize(
    "sync, field",
    [
        ({"every": 50, "fragments": 3}, "sync.every=50 is not divisible by sync.fragments=3"),
        ({"every": 50, "fragments": 5, "overlap": 10}, "sync.overlap=10: must be below sync.every/sync.fragments = 10"),
        ({"every": 50, "overlap": -1}, "sync.overlap=-1"),
        ({"every": 50, "mode": "lazy"}, "sync.mode='lazy'"),
        ({"every": 50, "fragments": 2, "mode": "eager"}, "sync.mode=eager overlaps the whole sync"),
        ({"every": 50, "overlap": 3, "mode": "delayed"}, "sync.mode=delayed overlaps the whole sync"),
        ({"every": 0}, "sync.every=0"),
    ],
)
def test_the_sync_section_names_what_cannot_work(sync: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        SyncConfig(**sync)
    assert field in str(e.value)


def test_the_schedule_of_each_mode() -> None:
    assert SyncSchedule(SyncConfig()).label == "blocking" and not SyncSchedule(SyncConfig()).overlapped
    s = SyncSchedule(SyncConfig(fragments=5, overlap=3))
    assert (s.label, s.round_steps, s.land_after, s.overlapped) == ("streaming", 10, 3, True)
    e = SyncSchedule(SyncConfig(mode="eager"))
    assert (e.label, e.round_steps, e.land_after, e.overlapped) == ("eager", 50, None, True)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"sync": {"every": 10, "fragments": 3}}, "sync.every=10 is not divisible by sync.fragments=3"),
        ({"sync": {"every": 10, "fragments": 2, "overlap": 5}}, "sync.overlap=5: must be below"),
        ({"sync": {"overlap": 2, "local_weight": 1.5}}, "sync.local_weight=1.5: must be null (0.5 with overlap, else 0) or a number in [0, 1]"),
        ({"sync": {"local_weight": -0.1}}, "sync.local_weight=-0.1"),
        ({"sync": {"merge": "average"}}, "sync.merge='average': must be one of mix, delta, ahead"),
        ({"sync": {"streams": 0}}, "sync.streams=0: must be an integer in 1..64"),
        ({"sync": {"mode": "eager", "fragments": 2}}, "sync.mode=eager overlaps the whole sync"),
        (
            {"outer": {"name": "Adam", "lr": 0.01}, "sync": {"mode": "eager"}},
            "sync.mode=eager follows the outer step's momentum from the updates: it needs outer.name=SGD (this run has outer.name=Adam)",
        ),
        ({"outer": {"kwargs": {"weight_decay": 0.1}}, "sync": {"mode": "eager"}}, "outer.kwargs.weight_decay=0.1"),
        ({"sync": {"mode": "eager", "lookahead_weight": -0.5}}, "sync.lookahead_weight=-0.5: must be null (eager 0.5, ahead 0) or a number in [0, 1]"),
        (
            {"outer": {"name": "Adam", "lr": 0.01}, "sync": {"fragments": 2, "overlap": 1, "merge": "ahead"}},
            "sync.merge=ahead follows the outer step's momentum from the updates: it needs outer.name=SGD",
        ),
        ({"sync": {"merge": "ahead", "mode": "delayed"}}, "sync.merge=ahead looks ahead of a fragment's round"),
        ({"sync": {"mode": "eager", "lookahead_weight": 1.5}}, "sync.lookahead_weight=1.5"),
        (
            {"sync": {"mode": "delayed", "lookahead_weight": 0.5}},
            "sync.lookahead_weight=0.5: only for sync.mode=eager or sync.merge=ahead (this run has mode=delayed, merge=mix)",
        ),
        ({"quorum": {"late": "merge"}, "sync": {"fragments": 2}}, "sync.fragments=2 cannot be combined with quorum.late=merge"),
        ({"robust": {"norm_ratio": 3}, "sync": {"fragments": 2}}, "sync.fragments=2 cannot be combined with robust.norm_ratio"),
        ({"guard": {"factor": 3}, "sync": {"fragments": 2}}, "sync.fragments=2 cannot be combined with guard.factor"),
        ({"sync": {"fragments": 2, "end": "drop"}}, "sync.end='drop': must be one of flush, freeze"),
        ({"sync": {"fragments": 2, "split": "layers"}}, "sync.split='layers': must be one of strided, balanced"),
        ({"sync": {"end": "freeze"}}, "sync.end=freeze stops each fragment at its last push: it needs sync.fragments > 1"),
    ],
)
def test_the_run_config_refuses_what_streaming_cannot_do(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        run_config_from_dict(overrides)
    assert field in str(e.value)


def test_the_local_weight_defaults_to_a_half_with_overlap_and_to_replacing_without() -> None:
    assert run_config_from_dict({}).sync.local_weight == 0.0
    cfg = run_config_from_dict({"sync": {"every": 10, "fragments": 2, "overlap": 2}})
    assert cfg.sync.local_weight == 0.5 and cfg.schedule.round_steps == 5


def test_fragments_add_flush_rounds_so_every_step_reaches_theta() -> None:
    cfg = run_config_from_dict({"rounds": 2, "sync": {"every": 12, "fragments": 3}})
    # 2 x 3 rounds of 4 steps, then fragments 0 and 1 push what they trained since their last sync
    assert cfg.sync_rounds == 2 * 3 + 2
    assert [cfg.schedule.steps_of(r) for r in range(cfg.sync_rounds)] == [4] * 6 + [0, 0]
    assert run_config_from_dict({"rounds": 7}).sync_rounds == 7
    # the coordinator averages those two into θ without the outer step
    from diloco.app.coordinator import CoordinatorOptions, coordinator_config

    assert coordinator_config(cfg, CoordinatorOptions(), "model", True).flush_rounds == 2
    assert coordinator_config(run_config_from_dict({"rounds": 7}), CoordinatorOptions(), "model", True).flush_rounds == 0


def test_frozen_fragments_need_no_flush_rounds() -> None:
    from diloco.app.coordinator import CoordinatorOptions, coordinator_config

    cfg = run_config_from_dict({"rounds": 2, "sync": {"every": 12, "fragments": 3, "end": "freeze"}})
    assert cfg.sync_rounds == 2 * 3 and [cfg.schedule.steps_of(r) for r in range(6)] == [4] * 6
    assert [cfg.schedule.frozen_after(r) for r in range(6)] == [False] * 3 + [True] * 3  # each fragment's last round
    coordinator = coordinator_config(cfg, CoordinatorOptions(), "model", True)
    assert coordinator.flush_rounds == 0 and coordinator.frozen_end
    assert not any(run_config_from_dict({"rounds": 2, "sync": {"every": 12, "fragments": 3}}).schedule.frozen_after(r) for r in range(8))


def test_more_fragments_than_layers_is_refused_before_any_process_starts() -> None:
    from diloco.sim.sections import check_before_start

    with pytest.raises(ConfigError, match="sync.fragments=4: the model has only 3 layer"):
        check_before_start(run_config_from_dict({"sync": {"every": 8, "fragments": 4}}))
