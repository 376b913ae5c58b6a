"""The degrees of parallelism inside a site (the ``parallel`` section, the layout names as its
shorthands): what each site builds, and every refusal naming its key. Plain config: no
process group, no process."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.app.config import ConfigError, RunConfig, run_config_defaults, run_config_from_dict
from diloco.site.layouts.config import LAYOUT_RANKS, SHORTHANDS, LayoutConfig, ParallelConfig, ParallelDims

CUSTOM = {"name": "custom", "factory": "tests.user_models:mlp_lm"}
LLAMA = {
    "name": "hf",
    "parallelize": "diloco.site.layouts.hf_llama:parallelize",
    "config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
}


def run(**sections: Any) -> RunConfig:
    """A RunConfig from the defaults with ``sections`` merged in (``parallel={...}``, ``model={...}``)."""
    d = run_config_defaults()
    for key, value in sections.items():
        d[key] = {**d[key], **value} if isinstance(d.get(key), dict) and key != "model" else value
    return run_config_from_dict(d)


def degrees(dims: ParallelDims) -> tuple[int, int, int, int]:
    return dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp


@pytest.mark.parametrize(
    ("name", "expected"),
    [("single", (1, 1, 1, 1)), ("ddp2", (1, 2, 1, 1)), ("fsdp2", (1, 1, 2, 1)), ("tp2", (1, 1, 1, 2)), ("pp2", (2, 1, 1, 1)), ("tp2_fsdp2", (1, 1, 2, 2))],
)
def test_each_layout_name_is_a_shorthand_for_degrees(name: str, expected: tuple[int, int, int, int]) -> None:
    dims = run(layout={"name": name}).layout_of(0)
    assert degrees(dims) == expected and dims.ranks == LAYOUT_RANKS[name] and dims.name == name
    assert set(SHORTHANDS) == set(LAYOUT_RANKS)


def test_degrees_set_in_parallel_replace_the_names() -> None:
    # on the default layout (single): any product
    dims = run(parallel={"dp_replicate": 2, "dp_shard": 2, "tp": 2}).layout_of(0)
    assert degrees(dims) == (1, 2, 2, 2) and dims.ranks == 8 and dims.dp == 4 and dims.name == "dp_replicate2_dp_shard2_tp2"
    # on a name: the name's degrees, the set ones replaced; degrees that make a shorthand take its name
    assert run(layout={"name": "fsdp2"}, parallel={"tp": 2}).layout_of(0).name == "tp2_fsdp2"
    assert degrees(run(layout={"name": "tp2_fsdp2"}, parallel={"dp_shard": 4}).layout_of(0)) == (1, 1, 4, 2)
    # site_layouts: one name per site, the parallel degrees on top of each
    cfg = run(sites=3, site_layouts=["tp2", "pp2", "single"], parallel={"dp_shard": 2}, data={"batch_size": 8})
    assert [cfg.layout_of(s).name for s in range(3)] == ["tp2_fsdp2", "pp2_dp_shard2", "fsdp2"]
    assert [cfg.layout_of(s).ranks for s in range(3)] == [4, 4, 2]


def test_dp_shard_minus_one_takes_the_ranks_left() -> None:
    dims = run(parallel={"dp_shard": -1, "tp": 2}).layout_of(0)
    assert dims.ranks is None  # decided by the ranks torchrun starts
    assert degrees(dims.for_ranks(8)) == (1, 1, 4, 2) and dims.for_ranks(4).name == "tp2_fsdp2"
    with pytest.raises(
        ValueError, match=r"parallel.dp_shard=-1: the site's 6 rank\(s\) do not divide by the other degrees' product 4 \(parallel.pp=2 × parallel.tp=2\)"
    ):
        ParallelDims.of(LayoutConfig(), ParallelConfig(dp_shard=-1, tp=2, pp=2)).for_ranks(6)


def test_a_product_that_is_not_the_launched_ranks_names_the_keys() -> None:
    with pytest.raises(ValueError, match=r"layout fsdp2 needs 2 rank\(s\); this site was launched with 4 \(start it with torchrun --nproc-per-node=2\)"):
        ParallelDims.named("fsdp2").for_ranks(4)
    dims = ParallelDims.of(LayoutConfig(), ParallelConfig(dp_shard=2, tp=2))
    with pytest.raises(ValueError, match=r"parallel.dp_shard=2 × parallel.tp=2 needs 4 rank\(s\); this site was launched with 2"):
        dims.for_ranks(2)
    assert dims.for_ranks(4) == dims


def test_coordinates_are_row_major_pp_outermost_tp_innermost() -> None:
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    assert [tuple(dims.coordinates(r).values()) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (1, 0, 0, 1), (1, 0, 1, 1)]


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"parallel": {"tp": 0}}, r"parallel.tp=0: must be an integer >= 1 \(or null: the layout's\)"),
        ({"parallel": {"pp": True}}, r"parallel.pp=True: must be an integer >= 1"),
        ({"parallel": {"dp_shard": -2}}, r"parallel.dp_shard=-2: must be an integer >= 1, or -1 \(the ranks left\)"),
        ({"parallel": {"pp_microbatches": 0}}, r"parallel.pp_microbatches=0: must be an integer >= 1"),
        ({"parallel": {"tensor": 2}}, r"unknown config key\(s\) parallel.tensor; known: dp_replicate, dp_shard, pp, pp_microbatches, tp"),
        ({"layout": {"microbatches": 4}}, r"layout.microbatches: renamed, use parallel.pp_microbatches"),
        ({"parallel": {"tp": 3}}, r"parallel.tp=3: must divide model.n_heads=4"),
        ({"parallel": {"tp": 2}, "model": {"name": "tiny", "mlp_hidden": 351}}, r"parallel.tp=2: must divide model.mlp_hidden=351"),
        ({"parallel": {"pp": 4}}, r"parallel.pp=4: more pipeline stages than model.n_layers=3"),
        (
            {"layout": {"name": "pp2"}, "parallel": {"pp_microbatches": 1}},
            r"parallel.pp_microbatches=1: the 1F1B schedule needs at least one microbatch per stage \(pp=2 \(layout=pp2\)\)",
        ),
        ({"parallel": {"dp_shard": 3}}, r"data.batch_size=16: must be a multiple of the site's 3 data-parallel groups \(parallel.dp_shard=3\)"),
        (
            {"layout": {"name": "pp2"}, "parallel": {"dp_replicate": 2, "pp_microbatches": 3}},
            r"data.batch_size=16: each of the 2 data-parallel share\(s\), 8 sequences, must be a multiple of parallel.pp_microbatches=3",
        ),
        ({"site_layouts": ["tp2", "tp9", "single", "single"]}, r"layout='tp9': unknown; known layouts: single, ddp2, fsdp2, tp2, pp2, tp2_fsdp2"),
        ({"model": CUSTOM, "layout": {"name": "tp2"}}, r"tp=2 \(layout=tp2\): model=custom needs model.parallelize=package.module:function"),
        ({"model": CUSTOM, "parallel": {"pp": 2}}, r"parallel.pp=2: pipeline stages cut the built-in transformer's blocks; model=custom runs with pp=1"),
        (
            {"model": {**CUSTOM, "parallelize": "x:y"}, "layout": {"activation_checkpointing": True}},
            r"layout.activation_checkpointing=true: wraps the built-in",
        ),
        ({"model": LLAMA, "parallel": {"tp": 4}}, r"parallel.tp=4: model.config.num_key_value_heads=2 is not divisible by it"),
        ({"model": {**CUSTOM, "parallelize": 3}}, r"model.parallelize=3: must be a string 'package.module:function'"),
    ],
)
def test_refusals_name_the_key(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run(**sections)


def test_model_parallelize_lifts_the_tensor_parallel_refusal() -> None:
    # (the config does not import it: check_before_start and the sites do)
    cfg = run(model={**CUSTOM, "parallelize": "my_models.parallel:apply_tp"}, parallel={"tp": 2, "dp_shard": 2})
    assert cfg.layout_of(0).name == "tp2_fsdp2" and cfg.model.parallelize == "my_models.parallel:apply_tp"  # type: ignore[union-attr]
    assert run(model=LLAMA, parallel={"tp": 2}).layout_of(0).ranks == 2
    # data parallelism alone needs nothing of the model
    assert run(model=CUSTOM, parallel={"dp_replicate": 2, "dp_shard": 2}).layout_of(0).ranks == 4


def test_the_degrees_round_trip_through_plain_data() -> None:
    from diloco.app.config import run_config_to_dict

    cfg = run(layout={"name": "pp2"}, parallel={"dp_shard": 2, "pp_microbatches": 4})
    again = run_config_from_dict(run_config_to_dict(cfg))
    assert again == cfg and again.layout_of(0) == cfg.layout_of(0)
