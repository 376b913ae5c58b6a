"""The outer step a run gets when it does not choose one (diloco.outer.defaults): the rule
docs/outer.md and the README state is the one in force, for every way a run is configured,
and ``outer.auto=false`` (or any outer key the run sets) leaves exactly what was written."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.app.config import ConfigError, RunConfig, run_config_defaults, run_config_from_dict, run_config_to_dict
from diloco.outer import OuterConfig
from diloco.outer.defaults import AUTO_DECAY_FROM, AUTO_FINAL_AVERAGE, AUTO_LR, AUTO_LR_MIN_RATIO, AUTO_MOMENTUM, AUTO_MOMENTUM_WARMUP, RULE_KEYS, auto_outer

ROOT = Path(__file__).resolve().parents[2]
RULE = f"lr {AUTO_LR}, momentum {AUTO_MOMENTUM} warmed up over min({AUTO_MOMENTUM_WARMUP}, rounds) rounds"
DECAY = f"from {AUTO_DECAY_FROM} rounds on a cosine lr decay to {AUTO_LR_MIN_RATIO} x lr"
FINAL = "the last round an average"


def test_the_documented_rule_is_the_one_in_force() -> None:
    for doc in ("docs/outer.md", "README.md", "conf/run.yaml"):
        text = " ".join((ROOT / doc).read_text().replace("×", "x").split())
        for part in (RULE, DECAY, FINAL):
            assert part in text, f"{doc} does not state the rule in force: {part}"
    for rounds in (1, 3, 5, 10, AUTO_DECAY_FROM - 1, AUTO_DECAY_FROM, 60):
        long = rounds >= AUTO_DECAY_FROM
        decay = {"lr_decay": "cosine", "lr_min_ratio": AUTO_LR_MIN_RATIO} if long else {}
        rule = {"lr": AUTO_LR, "momentum": AUTO_MOMENTUM, "momentum_warmup": min(AUTO_MOMENTUM_WARMUP, rounds), "final_average": AUTO_FINAL_AVERAGE, **decay}
        expected = OuterConfig(**rule)  # type: ignore[arg-type]
        assert auto_outer(rounds) == rule
        # Every way a run is configured: plain data without an outer section, the defaults as
        # hydra composes them (null fields), the Python API, and config.json read back.
        for cfg in (run_config_from_dict({"rounds": rounds}), run_config_from_dict({**run_config_defaults(), "rounds": rounds}), RunConfig(rounds=rounds)):
            assert cfg.outer == expected, rounds
            assert run_config_from_dict(run_config_to_dict(cfg)) == cfg  # config.json, as every process reads it


def test_hydra_composes_the_rule() -> None:
    from hydra import compose, initialize_config_module

    from diloco.cli.common import SECTIONS, run_config

    with initialize_config_module("diloco.conf", version_base=None):
        cfg = run_config(compose("sim", overrides=["rounds=3"]), SECTIONS["sim"])
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.momentum_warmup) == (AUTO_LR, AUTO_MOMENTUM, 3)


@pytest.mark.parametrize("key", RULE_KEYS)
def test_any_outer_key_the_run_sets_turns_the_rule_off(key: str) -> None:
    value = {"name": "SGD", "lr": 0.5, "momentum": 0.8, "nesterov": True, "momentum_warmup": 2, "lr_decay": "linear", "lr_min_ratio": 0.2}[key]
    cfg = run_config_from_dict({"outer": {key: value}, "rounds": 60})
    assert cfg.outer == OuterConfig(**{key: value})  # what it wrote, today's Nesterov SGD for the rest


def test_the_run_may_set_final_average_and_keep_the_rest_of_the_rule() -> None:
    cfg = run_config_from_dict({"outer": {"final_average": False}, "rounds": 10})
    assert cfg.outer == OuterConfig(lr=AUTO_LR, momentum=AUTO_MOMENTUM, momentum_warmup=AUTO_MOMENTUM_WARMUP, final_average=False)
    assert run_config_from_dict({"outer": {"auto": False}}).outer.final_average is False


def test_auto_false_keeps_exactly_what_is_written() -> None:
    assert run_config_from_dict({"outer": {"auto": False}}).outer == OuterConfig(auto=False)  # lr 0.7, momentum 0.9, no warm-up
    d = run_config_defaults()
    d["outer"]["auto"] = False
    assert run_config_from_dict(d).outer == OuterConfig(auto=False)
    with pytest.raises(ConfigError, match="outer.auto='yes': must be true or false"):
        run_config_from_dict({"outer": {"auto": "yes"}})


def test_sparse_codecs_keep_their_own_best() -> None:
    assert run_config_from_dict({"codec": "topk2bit"}).outer == OuterConfig(lr=1.25, momentum=0.0, nesterov=False)
