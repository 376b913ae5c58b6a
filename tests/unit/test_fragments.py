"""The fragment split (strided over the layers, deterministic), the sync schedule's checks, and
the run config refusing what streaming, overlap and eager cannot do, naming the field."""

from __future__ import annotations

import pytest
import torch

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.model import build_model, model_config
from diloco.outer.fragments import describe, fragment_of_round, layer_of, split_fragments
from diloco.site.overlap import SyncSchedule


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
    "fragments, why", [(0, "fragments=0: must be an integer >= 1"), (4, "fragments=4: the model has only 3 layer(s)"), (True, "fragments=True")]
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
    [(6, "balanced", "fragments=6: the model has only 5 tensor(s)"), (2, "random", "fragment_split='random': must be one of strided, balanced")],
)
def test_bad_balanced_splits_are_refused(fragments: int, how: str, why: str) -> None:
    shapes = {"blocks.0.a": (6,), "blocks.0.b": (5,), "blocks.1.a": (4,), "blocks.1.b": (3,), "emb": (2,)}
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        split_fragments(shapes, fragments, how)


@pytest.mark.parametrize(
    "schedule, field",
    [
        (SyncSchedule(sync_every=50, fragments=3), "sync_every=50 is not divisible by fragments=3"),
        (SyncSchedule(sync_every=50, fragments=5, overlap_steps=10), "overlap_steps=10: must be below sync_every/fragments = 10"),
        (SyncSchedule(sync_every=50, overlap_steps=-1), "overlap_steps=-1"),
        (SyncSchedule(sync_every=50, outer_mode="lazy"), "outer_mode='lazy'"),
        (SyncSchedule(sync_every=50, fragments=2, outer_mode="eager"), "outer_mode=eager overlaps the whole sync"),
        (SyncSchedule(sync_every=50, overlap_steps=3, outer_mode="delayed"), "outer_mode=delayed overlaps the whole sync"),
        (SyncSchedule(sync_every=0), "sync_every=0"),
    ],
)
def test_the_schedule_names_what_cannot_work(schedule: SyncSchedule, field: str) -> None:
    why = schedule.problem()
    assert why is not None and field in why


def test_the_schedule_of_each_mode() -> None:
    assert SyncSchedule(50).mode == "blocking" and not SyncSchedule(50).overlapped
    s = SyncSchedule(50, fragments=5, overlap_steps=3)
    assert (s.mode, s.round_steps, s.land_after, s.overlapped) == ("streaming", 10, 3, True)
    e = SyncSchedule(50, outer_mode="eager")
    assert (e.mode, e.round_steps, e.land_after, e.overlapped) == ("eager", 50, None, True)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"sync_every": 10, "fragments": 3}, "sync_every=10 is not divisible by fragments=3"),
        ({"sync_every": 10, "fragments": 2, "overlap_steps": 5}, "overlap_steps=5: must be below"),
        ({"overlap_steps": 2, "alpha": 1.5}, "alpha=1.5: must be a number in [0, 1]"),
        ({"alpha": -0.1}, "alpha=-0.1"),
        ({"merge": "average"}, "merge='average': must be alpha"),
        ({"streams": 0}, "streams=0: must be an integer in 1..64"),
        ({"outer_mode": "eager", "fragments": 2}, "outer_mode=eager overlaps the whole sync"),
        (
            {"outer_mode": "eager", "outer": {"name": "Adam", "lr": 0.01}},
            "outer_mode=eager follows the outer step's momentum from the updates: it needs outer.name=SGD (this run has outer.name=Adam)",
        ),
        ({"outer_mode": "eager", "outer": {"kwargs": {"weight_decay": 0.1}}}, "outer.kwargs.weight_decay=0.1"),
        ({"outer_mode": "eager", "eager_weight": -0.5}, "eager_weight=-0.5: must be null (eager 0.5, ahead 0) or a number in [0, 1]"),
        (
            {"fragments": 2, "overlap_steps": 1, "merge": "ahead", "outer": {"name": "Adam", "lr": 0.01}},
            "merge=ahead follows the outer step's momentum from the updates: it needs outer.name=SGD",
        ),
        ({"merge": "ahead", "outer_mode": "delayed"}, "merge=ahead looks ahead of a fragment's round"),
        ({"outer_mode": "eager", "eager_weight": 1.5}, "eager_weight=1.5"),
        (
            {"outer_mode": "delayed", "eager_weight": 0.5},
            "eager_weight=0.5: only for outer_mode=eager or merge=ahead (this run has outer_mode=delayed, merge=alpha)",
        ),
        ({"fragments": 2, "quorum": {"late": "merge"}}, "fragments=2 cannot be combined with quorum.late=merge"),
        ({"fragments": 2, "robust": {"norm_ratio": 3}}, "fragments=2 cannot be combined with robust.norm_ratio"),
        ({"fragments": 2, "guard": {"factor": 3}}, "fragments=2 cannot be combined with guard.factor"),
        ({"fragments": 2, "fragment_end": "drop"}, "fragment_end='drop': must be one of flush, freeze"),
        ({"fragments": 2, "fragment_split": "layers"}, "fragment_split='layers': must be one of strided, balanced"),
        ({"fragment_end": "freeze"}, "fragment_end=freeze stops each fragment at its last push: it needs fragments > 1"),
    ],
)
def test_the_run_config_refuses_what_streaming_cannot_do(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        run_config_from_dict(overrides)
    assert field in str(e.value)


def test_alpha_defaults_to_a_half_with_overlap_and_to_replacing_without() -> None:
    assert run_config_from_dict({}).alpha == 0.0
    cfg = run_config_from_dict({"sync_every": 10, "fragments": 2, "overlap_steps": 2})
    assert cfg.alpha == 0.5 and cfg.schedule.round_steps == 5


def test_fragments_add_flush_rounds_so_every_step_reaches_theta() -> None:
    cfg = run_config_from_dict({"sync_every": 12, "fragments": 3, "rounds": 2})
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

    cfg = run_config_from_dict({"sync_every": 12, "fragments": 3, "rounds": 2, "fragment_end": "freeze"})
    assert cfg.sync_rounds == 2 * 3 and [cfg.schedule.steps_of(r) for r in range(6)] == [4] * 6
    assert [cfg.schedule.frozen_after(r) for r in range(6)] == [False] * 3 + [True] * 3  # each fragment's last round
    coordinator = coordinator_config(cfg, CoordinatorOptions(), "model", True)
    assert coordinator.flush_rounds == 0 and coordinator.frozen_end
    assert not any(run_config_from_dict({"sync_every": 12, "fragments": 3, "rounds": 2}).schedule.frozen_after(r) for r in range(8))


def test_more_fragments_than_layers_is_refused_before_any_process_starts() -> None:
    from diloco.sim.sections import check_before_start

    with pytest.raises(ConfigError, match="fragments=4: the model has only 3 layer"):
        check_before_start(run_config_from_dict({"sync_every": 8, "fragments": 4}))
