"""RunConfig checks name the field they reject."""

import pytest

from diloco.app.config import ConfigError, RunConfig, run_config_from_dict, run_config_to_dict
from diloco.sync import SyncConfig

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"sync": {"every": 0}}, "sync.every=0"),
        ({"sites": 0}, "sites=0"),
        ({"rounds": -1}, "rounds=-1"),
        ({"mode": "allreduce"}, "mode='allreduce'"),
        ({"codec": "gzip"}, "codec='gzip'"),
        ({"codec": {"name": "int8", "density": 0.1}}, "takes no density"),
        ({"codec": {"name": "topk2bit", "density": 0}}, "density=0"),
        ({"codec": {"name": "int8", "zstd": True, "zstd_level": 99}}, "zstd level=99"),
        ({"codec": {"name": "int8", "speed": 1}}, "speed"),
        ({"codec_down": "int9"}, "codec_down='int9'"),
        ({"model": {"name": "huge"}}, "model=huge"),
        ({"inner": {"lr": 0}}, "inner.lr"),
        ({"outer": {"name": "Nope"}}, "outer.name"),
        ({"data": {"batch_size": 0}}, "data.batch_size"),
        ({"data": {"colour": 1}}, "data.colour"),
        ({"speed": 3}, "speed"),
        ({"quorum": {"lease_s": 0}}, "quorum.lease_s=0"),
        ({"quorum": {"deadline": "soon"}}, "deadline='soon'"),
        ({"quorum": {"colour": 1}}, "quorum.colour"),
        ({"error_feedback_decay": 1.5}, "error_feedback_decay=1.5"),
        ({"quorum": {"min_sites": 9}}, "quorum.min_sites=9"),
        ({"guard": {"factor": 0.5}}, "guard.factor=0.5"),
        ({"error_feedback_decay": -0.1}, "error_feedback_decay=-0.1"),
        ({"aggregate": "mode"}, "aggregate='mode': must be one of mean, nonzero, trimmed_mean, median"),
        ({"fragments": 2}, "fragments: renamed, use sync.fragments"),
        ({"robust": {"aggregate": "median"}}, "robust.aggregate: renamed, use aggregate"),
    ],
)
def test_bad_values_name_the_field(override: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        run_config_from_dict({**run_config_to_dict(RunConfig()), **override})
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("faults", "field"),
    [
        ({"events": [{"kind": "explode"}]}, "faults.events[0].kind='explode'"),
        ({"events": [{"kind": "kill_site", "site": 1}]}, "faults.events[0]: kill_site needs at_round"),
        ({"events": [{"kind": "kill_site", "site": 9, "at_round": 1}]}, "faults.events[0].site=9"),
        ({"events": [{"kind": "kill_coordinator", "at_round": 99}]}, "faults.events[0].at_round=99"),
        ({"events": [{"kind": "drop_push", "prob": 0.1}, {"kind": "drop_push", "prob": 1.5}]}, "faults.events[1].prob=1.5"),
        ({"events": [{"kind": "drop_push", "prob": 0.3, "lost": "yes"}]}, "faults.events[0].lost='yes': must be true or false"),
        ({"events": [{"kind": "slow_site", "site": 0, "factor": 2, "lost": True}]}, "slow_site takes no lost"),
        ({"events": [{"kind": "kill_site", "site": 0, "at_round": 1, "phase": "lunch"}]}, "phase='lunch'"),
        ({"events": [{"kind": "slow_site", "site": 0, "factor": 2, "seconds": 3}]}, "slow_site takes no seconds"),
        ({"events": [{"kind": "diverge_site", "site": 0}]}, "faults.events[0]: diverge_site needs at_round"),
        ({"events": [{"kind": "diverge_site", "site": 0, "at_round": 1, "factor": 2}]}, "diverge_site takes no factor"),
        ({"events": [{"kind": "diverge_site", "site": 7, "at_round": 1}]}, "faults.events[0].site=7"),
        ({"colour": 1}, "faults.colour"),
    ],
)
def test_bad_fault_events_name_the_event_and_key(faults: dict, field: str) -> None:
    """The simulation owns its fault events (diloco.sim): checked against the run's sites and rounds."""
    from diloco.sim.sections import sim_faults

    with pytest.raises(ConfigError) as info:
        sim_faults(faults, RunConfig())
    assert field in str(info.value)


def test_round_trip_and_workers() -> None:
    cfg = run_config_from_dict({"mode": "single", "sites": 4, "model": {"name": "small"}})
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    assert cfg.workers == 1 and cfg.model.d_model == 256
    assert RunConfig(sites=3).workers == 3 and RunConfig(rounds=4, sync=SyncConfig(every=5)).total_steps == 20


def test_codec_group_and_downlink_default() -> None:
    from diloco.codec import CodecConfig

    cfg = run_config_from_dict({"codec": {"name": "int8", "block": 512, "zstd": True, "zstd_level": 5}})
    codec = cfg.codec.build()
    assert codec.name == "int8+zstd" and codec.inner.block == 512 and codec.level == 5
    assert cfg.codec.describe() == "int8(block=512)+zstd(level=5)"
    # The downlink defaults to the uplink's codec, parameters included; a name or a mapping overrides it.
    assert cfg.downlink_codec == cfg.codec
    assert run_config_from_dict({"codec": "int8", "codec_down": "bf16"}).downlink_codec == CodecConfig(name="bf16")
    # Uplinks below 8 bits per value get an int8 downlink.
    assert run_config_from_dict({"codec": "topk2bit+zstd"}).downlink_codec == CodecConfig(name="int8", zstd=True)
    assert run_config_from_dict({"codec": "e3m0"}).downlink_codec == CodecConfig(name="int8")
    assert run_config_from_dict({"codec": "bf16"}).downlink_codec == CodecConfig(name="bf16")
    down = run_config_from_dict({"codec_down": {"name": "topk2bit", "density": 0.05}}).downlink_codec
    assert down.build().density == 0.05
    # zstd_level is carried by every shipped config but read only when zstd is on.
    assert CodecConfig(name="fp16", zstd_level=3).build().name == "fp16"
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg


SPARSE_DECAY, SPARSE_LR = 0.8, 1.25  # conf/recipe/sparse.yaml


@pytest.mark.parametrize("config_name", ["sim", "coordinator", "site"])
@pytest.mark.parametrize(("recipe", "decay", "aggregate", "lr"), [("sparseloco", 0.95, "mean", 1.0), ("sparse", SPARSE_DECAY, "nonzero", SPARSE_LR)])
def test_the_sparse_recipes_set_codec_decay_aggregate_and_outer(config_name: str, recipe: str, decay: float, aggregate: str, lr: float) -> None:
    from hydra import compose, initialize_config_module

    from diloco.cli.common import SECTIONS, run_config

    sections = SECTIONS[config_name]
    with initialize_config_module("diloco.conf", version_base=None):
        cfg = run_config(compose(config_name, overrides=[f"recipe={recipe}"]), sections)
        # a key on the command line still wins over the recipe
        mine = run_config(compose(config_name, overrides=[f"recipe={recipe}", "outer.lr=0.5", "codec.density=0.01"]), sections)
        plain = run_config(compose(config_name), sections)
    assert cfg.codec.name == "topk2bit" and cfg.error_feedback and cfg.error_feedback_decay == decay and cfg.aggregate == aggregate
    assert (cfg.outer.name, cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == ("SGD", lr, 0.0, False)
    assert cfg.downlink_codec.name == "int8"  # every process of a run composes the same math
    assert mine.outer.lr == 0.5 and mine.codec.density == 0.01 and mine.error_feedback_decay == decay
    assert (plain.codec.name, plain.error_feedback_decay, plain.outer.momentum, plain.aggregate) == ("fp32", 1.0, 0.9, "mean")


@pytest.mark.parametrize("config_name", ["sim", "coordinator", "site"])
def test_the_composed_hydra_defaults_are_the_dataclasses_defaults(config_name: str) -> None:
    """conf/*.yaml repeat RunConfig's defaults for the command line; nothing may drift."""
    from hydra import compose, initialize_config_module

    from diloco.cli.common import SECTIONS, run_config

    with initialize_config_module("diloco.conf", version_base=None):
        composed = run_config(compose(config_name), SECTIONS[config_name])
    assert composed == RunConfig()
    assert run_config_to_dict(composed) == run_config_to_dict(RunConfig())


@pytest.mark.parametrize(
    ("codec", "aggregate", "decay"),
    [("fp32", "mean", 1.0), ("int8", "mean", 1.0), ("e3m0+zstd", "mean", 1.0), ("topk2bit", "nonzero", 0.8), ("topk2bit+zstd", "nonzero", 0.8)],
)
def test_a_codec_brings_its_best_settings_unless_they_are_set(codec: str, aggregate: str, decay: float) -> None:
    from diloco.app.config import run_config_defaults
    from diloco.outer import OuterConfig

    sparse = codec.startswith("topk2bit")
    # Dense codecs: the measured rule for a 10-round run (tests/unit/test_outer_defaults.py).
    best_outer = OuterConfig(lr=1.25, momentum=0.0, nesterov=False) if sparse else OuterConfig(lr=1.0, momentum=0.9, momentum_warmup=10, final_average=True)
    for cfg in (run_config_from_dict({"codec": codec}), RunConfig(codec=codec), run_config_from_dict({**run_config_defaults(), "codec": codec})):
        assert (cfg.aggregate, cfg.error_feedback_decay, cfg.outer_step) == (aggregate, decay, best_outer)
        assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    mine = run_config_from_dict({"codec": codec, "aggregate": "mean", "error_feedback_decay": 0.5, "outer": {"lr": 0.5}})
    assert (mine.aggregate, mine.error_feedback_decay) == ("mean", 0.5)
    # A run that sets the lr gets what it wrote, the codec's best (or the rule) for every other field.
    assert mine.outer_step == OuterConfig(**{**best_outer.__dict__, "lr": 0.5})


def test_the_library_refuses_unknown_enum_values_as_the_config_does() -> None:
    from diloco.coordinator import CoordinatorConfig
    from diloco.coordinator.round_policy import QuorumConfig

    with pytest.raises(ValueError, match="quorum.late='merg'"):
        CoordinatorConfig(total_rounds=1, quorum=QuorumConfig(late="merg"))
    with pytest.raises(ValueError, match="deadline='soon'"):
        CoordinatorConfig(total_rounds=1, quorum=QuorumConfig(deadline="soon"))
    with pytest.raises(ValueError, match="aggregate='mode'"):
        CoordinatorConfig(total_rounds=1, aggregate="mode")
    with pytest.raises(ValueError, match="unknown codec 'fp33'"):
        CoordinatorConfig(total_rounds=1, codec_down="fp33")
    with pytest.raises(ValueError, match="quorum=.*must be a QuorumConfig"):
        CoordinatorConfig(total_rounds=1, quorum={"late": "merge"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="quorum.late='merg'"):
        run_config_from_dict({"quorum": {"late": "merg"}})


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"shards": 0}, "coordinator.shards=0"),
        ({"shards": True}, "coordinator.shards=True"),
        ({"shards": 10_000}, "coordinator.shards=10000: must be an integer from 1 to the model's number of tensors"),
        ({"colour": 1}, "coordinator.colour"),
    ],
)
def test_diloco_sim_checks_the_coordinators_cut_before_anything_starts(section: dict, field: str) -> None:
    from diloco.sim.sections import sim_coordinator

    assert sim_coordinator({"shards": 3}, RunConfig()) == 3
    with pytest.raises(ConfigError) as info:
        sim_coordinator(section, RunConfig())
    assert field in str(info.value)
