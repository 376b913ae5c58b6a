"""RunConfig checks name the field they reject."""

import pytest

from diloco.config import ConfigError, RunConfig, run_config_from_dict, run_config_to_dict

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"sync_every": 0}, "sync_every=0"),
        ({"sites": 0}, "sites=0"),
        ({"rounds": -1}, "rounds=-1"),
        ({"mode": "allreduce"}, "mode='allreduce'"),
        ({"codec": "gzip"}, "codec='gzip'"),
        ({"model": {"name": "huge"}}, "model=huge"),
        ({"inner": {"lr": 0}}, "inner.lr"),
        ({"outer": {"name": "Nope"}}, "outer.name"),
        ({"data": {"batch_size": 0}}, "data.batch_size"),
        ({"data": {"colour": 1}}, "data.colour"),
        ({"speed": 3}, "speed"),
    ],
)
def test_bad_values_name_the_field(override: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        run_config_from_dict({**run_config_to_dict(RunConfig()), **override})
    assert field in str(info.value)


def test_round_trip_and_workers() -> None:
    cfg = run_config_from_dict({"mode": "single", "sites": 4, "model": {"name": "small"}})
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    assert cfg.workers == 1 and cfg.model.d_model == 256
    assert RunConfig(sites=3).workers == 3 and RunConfig(rounds=4, sync_every=5).total_steps == 20
