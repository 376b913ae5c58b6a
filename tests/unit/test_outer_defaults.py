"""The outer step a run gets (diloco.outer.defaults): the rule docs/outer.md and the README
state is the one in force, for every way a run is configured; each field a run sets replaces
that field alone; ``outer.rule=diloco`` is the paper's; a codec with its own best keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.app.config import ConfigError, RunConfig, run_config_defaults, run_config_from_dict, run_config_to_dict
from diloco.outer import OuterConfig
from diloco.outer.defaults import AUTO_DECAY_FROM, AUTO_FINAL_AVERAGE, AUTO_LR, AUTO_LR_MIN_RATIO, AUTO_MOMENTUM, AUTO_MOMENTUM_WARMUP, rule_values

ROOT = Path(__file__).resolve().parents[2]
RULE = f"lr {AUTO_LR}, momentum {AUTO_MOMENTUM} warmed up over min({AUTO_MOMENTUM_WARMUP}, rounds) rounds"
DECAY = f"from {AUTO_DECAY_FROM} rounds on a cosine lr decay to {AUTO_LR_MIN_RATIO} x lr"
FINAL = "the last round an average"


def _rule(rounds: int) -> OuterConfig:
    decay = {"lr_decay": "cosine", "lr_min_ratio": AUTO_LR_MIN_RATIO} if rounds >= AUTO_DECAY_FROM else {}
    return OuterConfig(lr=AUTO_LR, momentum=AUTO_MOMENTUM, momentum_warmup=min(AUTO_MOMENTUM_WARMUP, rounds), final_average=AUTO_FINAL_AVERAGE, **decay)  # type: ignore[arg-type]


def test_the_documented_rule_is_the_one_in_force() -> None:
    for doc in ("docs/outer.md", "README.md"):
        text = " ".join((ROOT / doc).read_text().replace("×", "x").split())
        for part in (RULE, DECAY, FINAL):
            assert part in text, f"{doc} does not state the rule in force: {part}"
    for rounds in (1, 3, 5, 10, AUTO_DECAY_FROM - 1, AUTO_DECAY_FROM, 60):
        assert OuterConfig(**rule_values("measured", rounds)) == _rule(rounds)
        # Every way a run is configured: plain data without an outer section, the defaults as
        # hydra composes them (null fields), the Python API, and config.json read back.
        for cfg in (run_config_from_dict({"rounds": rounds}), run_config_from_dict({**run_config_defaults(), "rounds": rounds}), RunConfig(rounds=rounds)):
            assert cfg.outer_step == _rule(rounds), rounds
            assert run_config_from_dict(run_config_to_dict(cfg)) == cfg  # config.json, as every process reads it


def test_hydra_composes_the_rule() -> None:
    from hydra import compose, initialize_config_module

    from diloco.cli.common import SECTIONS, run_config

    with initialize_config_module("diloco.conf", version_base=None):
        cfg = run_config(compose("sim", overrides=["rounds=3"]), SECTIONS["sim"])
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.momentum_warmup) == (AUTO_LR, AUTO_MOMENTUM, 3)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lr", 0.5),
        ("lr", AUTO_LR),
        ("momentum", 0.8),
        ("nesterov", False),
        ("momentum_warmup", 2),
        ("lr_decay", "linear"),
        ("lr_min_ratio", 0.2),
        ("final_average", False),
    ],
)
def test_each_outer_key_the_run_sets_replaces_that_field_alone(key: str, value: object) -> None:
    # outer.lr=1.0, the rule's own value, used to turn the warm-up, the decay and the final average off.
    cfg = run_config_from_dict({"outer": {key: value}, "rounds": 60})
    rule = _rule(60)
    assert cfg.outer_step == OuterConfig(
        **{**{k: getattr(rule, k) for k in ("lr", "momentum", "nesterov", "momentum_warmup", "lr_decay", "lr_min_ratio", "final_average")}, key: value}
    )  # type: ignore[arg-type]


def test_rule_diloco_is_the_papers_outer_step() -> None:
    assert run_config_from_dict({"outer": {"rule": "diloco"}}).outer_step == OuterConfig()  # Nesterov SGD, lr 0.7, momentum 0.9, no schedule
    assert run_config_from_dict({"outer": {"rule": "diloco", "lr": 0.5}}).outer_step == OuterConfig(lr=0.5)
    with pytest.raises(ConfigError, match="outer.rule='auto': must be one of measured, diloco"):
        run_config_from_dict({"outer": {"rule": "auto"}})


def test_another_optimizer_drops_what_does_not_apply_to_it() -> None:
    adam = run_config_from_dict({"outer": {"name": "Adam", "lr": 0.01}}).outer_step
    assert (adam.name, adam.lr, adam.momentum_warmup, adam.nesterov, adam.final_average) == ("Adam", 0.01, 0, False, AUTO_FINAL_AVERAGE)
    with pytest.raises(ConfigError, match="outer.name=Adam: set outer.lr too"):
        run_config_from_dict({"outer": {"name": "Adam"}})
    dn = run_config_from_dict({"outer": {"name": "DelayedNesterov", "period": 2}, "rounds": 10}).outer_step
    assert (dn.lr, dn.momentum, dn.momentum_warmup, dn.nesterov, dn.period) == (AUTO_LR, AUTO_MOMENTUM, 10, False, 2)


def test_the_old_switch_names_its_replacement() -> None:
    with pytest.raises(ConfigError, match="outer.auto: renamed, use outer.rule"):
        run_config_from_dict({"outer": {"auto": False}})


def test_sparse_codecs_keep_their_own_best() -> None:
    assert run_config_from_dict({"codec": "topk2bit"}).outer_step == OuterConfig(lr=1.25, momentum=0.0, nesterov=False)
    # a field set on top of the codec's best replaces that field alone
    assert run_config_from_dict({"codec": "topk2bit", "outer": {"lr": 1.0}}).outer_step == OuterConfig(lr=1.0, momentum=0.0, nesterov=False)
