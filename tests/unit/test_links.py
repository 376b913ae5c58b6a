"""diloco-sim's wan and site_wan sections: one link per site, the coordinator's, and bad values
refused naming the field."""

from __future__ import annotations

import pytest

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.sim.links import wan_plan
from diloco.sim.sections import sim_wan


def test_nothing_set_is_no_emulation() -> None:
    assert wan_plan(None, None, 4) is None
    assert wan_plan({"bandwidth_mbit": None, "rtt_ms": 0, "jitter_ms": 0, "coordinator": None}, None, 4) is None


def test_every_site_gets_the_shared_link_and_site_wan_overrides_it() -> None:
    plan = wan_plan({"bandwidth_mbit": 10, "rtt_ms": 100, "coordinator": {"bandwidth_mbit": 40}}, [{}, {"bandwidth_mbit": 100, "rtt_ms": 20}, None], 3)
    assert plan is not None
    assert plan.sites["0"].up_mbit == plan.sites["0"].down_mbit == 10.0 and plan.sites["0"].rtt_ms == 100.0
    assert plan.sites["1"].up_mbit == 100.0 and plan.sites["1"].rtt_ms == 20.0
    assert plan.sites["2"] == plan.sites["0"]
    assert plan.coordinator is not None and plan.coordinator.down_mbit == 40.0
    assert plan.to_dict()["sites"]["1"]["up_mbit"] == 100.0


def test_one_way_bandwidths() -> None:
    plan = wan_plan({"up_mbit": 5, "down_mbit": 50}, None, 1)
    assert plan is not None and (plan.sites["0"].up_mbit, plan.sites["0"].down_mbit) == (5.0, 50.0)


@pytest.mark.parametrize(
    "wan, site_wan, field",
    [
        ({"bandwidth_mbit": 0}, None, "wan.bandwidth_mbit=0"),
        ({"bandwidth_mbit": -5}, None, "wan.bandwidth_mbit=-5"),
        ({"rtt_ms": -1}, None, "wan.rtt_ms=-1"),
        ({"rtt_ms": 10}, [{}, {"up_mbit": 0}], "site_wan[1].up_mbit=0"),
        ({"latency": 3}, None, "wan.latency"),
        ({"rtt_ms": 10}, [{}], "site_wan: give a list of one link per site (2)"),
        ({"coordinator": {"bandwidth_mbit": 0}}, None, "wan.coordinator.bandwidth_mbit=0"),
    ],
)
def test_bad_links_are_refused_naming_the_field(wan: dict, site_wan: list | None, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        sim_wan(wan, site_wan, run_config_from_dict({"sites": 2}))
    assert field in str(e.value)


def test_a_baseline_has_no_coordinator_to_emulate_links_to() -> None:
    with pytest.raises(ConfigError, match="mode=ddp has no coordinator"):
        sim_wan({"rtt_ms": 10}, None, run_config_from_dict({"mode": "ddp", "sites": 2}))
