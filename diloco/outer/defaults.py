"""The ``outer`` section of a run's config, and the outer step it resolves to, field by field.

Every field of the section left null takes the value of the run's *base* outer step; every
field the run sets replaces that one field only. The base is

* the codec's measured best where it has one (``topk2bit``: plain SGD, lr 1.25, no momentum);
* else ``outer.rule``: ``measured`` (the default, docs/outer.md): Nesterov SGD, lr AUTO_LR,
  momentum AUTO_MOMENTUM warmed up over min(AUTO_MOMENTUM_WARMUP, rounds) rounds, from
  AUTO_DECAY_FROM rounds on a cosine lr decay to AUTO_LR_MIN_RATIO × lr, the last round an
  average (``final_average``); or ``diloco``: the paper's Nesterov SGD, lr 0.7, momentum 0.9,
  no schedule.

So ``outer.lr=0.5`` keeps the warm-up, the decay and the final average of the rule. A base
field that does not apply to another ``outer.name`` is dropped (momentum and its warm-up for
an optimizer without momentum, Nesterov for anything but SGD), and an optimizer other than
SGD and DelayedNesterov must be given its own ``outer.lr``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.fields import choice, setting
from diloco.outer.optimizer import MOMENTUM_OPTIMIZERS, OuterConfig

AUTO_LR = 1.0
AUTO_MOMENTUM = 0.9
AUTO_MOMENTUM_WARMUP = 10  # rounds
AUTO_DECAY_FROM = 60  # rounds: runs this long or longer get the lr decay (at 30 it hurt: docs/outer.md)
AUTO_LR_MIN_RATIO = 0.1  # the decay ends at this share of lr
AUTO_FINAL_AVERAGE = True  # the last round averages: −0.3 to −0.6% bpb at 10 and 30 rounds, both corpora (docs/outer.md)
# Fields a base sets (the rest, period and kwargs, have fixed defaults).
STEP_KEYS = ("name", "lr", "momentum", "nesterov", "lr_warmup", "lr_decay", "lr_min_ratio", "momentum_warmup", "final_average")


class OuterRule(enum.StrEnum):
    MEASURED = "measured"  # this project's measured rule (docs/outer.md)
    DILOCO = "diloco"  # the DiLoCo paper's: Nesterov SGD, lr 0.7, momentum 0.9, no schedule


@dataclass(frozen=True)
class OuterSection:
    """The ``outer`` section as a run writes it: null fields take the base's value (above)."""

    rule: OuterRule = setting(OuterRule.MEASURED, doc="the base of every null field: measured (docs/outer.md) | diloco (the paper's: lr 0.7, no schedule)")
    name: str | None = setting(None, doc="any torch.optim optimizer by class name, or DelayedNesterov; null: SGD (topk2bit: SGD)")
    lr: float | None = setting(None, doc="the outer learning rate; null: 1.0 (measured), 0.7 (diloco), 1.25 (topk2bit)")
    momentum: float | None = setting(None, doc="SGD and DelayedNesterov momentum; null: 0.9 (topk2bit: 0)")
    nesterov: bool | None = setting(None, doc="SGD: Nesterov momentum; null: true (topk2bit: false)")
    lr_warmup: int | None = setting(None, doc="outer steps of a linear lr warm-up (a fragment's own rounds with fragments); null: 0")
    lr_decay: str | None = setting(
        None, doc="none | linear | cosine, after the warm-up, to lr_min_ratio × lr at the end; null: cosine from 60 rounds (measured), else none"
    )
    lr_min_ratio: float | None = setting(None, doc="where the lr decay ends, as a share of lr; null: 0.1 (measured, from 60 rounds), else 0")
    momentum_warmup: int | None = setting(None, doc="outer steps of a linear momentum warm-up from 0; null: min(10, rounds) (measured), else 0")
    final_average: bool | None = setting(
        None, doc="each parameter's last round averages (θ − mean Δ) instead of the outer step; null: true (measured), else false"
    )
    period: int = setting(4, doc="DelayedNesterov only: outer steps between momentum updates (1: Nesterov SGD)")
    kwargs: Mapping[str, Any] = setting(doc="extra constructor arguments of the optimizer", factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", choice(OuterRule, self.rule, "outer.rule"))


def rule_values(rule: OuterRule | str, rounds: int) -> dict[str, Any]:
    """The outer step a rule gives a run of ``rounds`` rounds, every STEP_KEYS field set."""
    paper = {
        "name": "SGD",
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
        "lr_warmup": 0,
        "lr_decay": "none",
        "lr_min_ratio": 0.0,
        "momentum_warmup": 0,
        "final_average": False,
    }
    if OuterRule(rule) == OuterRule.DILOCO:
        return paper
    rounds = max(int(rounds), 0)
    measured = {**paper, "lr": AUTO_LR, "momentum": AUTO_MOMENTUM, "momentum_warmup": min(AUTO_MOMENTUM_WARMUP, rounds), "final_average": AUTO_FINAL_AVERAGE}
    if rounds >= AUTO_DECAY_FROM:
        measured.update(lr_decay="cosine", lr_min_ratio=AUTO_LR_MIN_RATIO)
    return measured


def resolve_outer(section: OuterSection, rounds: int, codec_best: Mapping[str, Any]) -> OuterSection:
    """The section with every field set: the base (``codec_best`` when not empty, else the
    rule's for ``rounds``), then each field the section sets. ValueError naming the field."""
    base = {**rule_values(OuterRule.DILOCO, rounds), **codec_best} if codec_best else rule_values(section.rule, rounds)
    given = {k: getattr(section, k) for k in STEP_KEYS if getattr(section, k) is not None}
    name = given.get("name", base["name"])
    if name != base["name"]:
        if name not in MOMENTUM_OPTIMIZERS:
            base.update(momentum=0.0, momentum_warmup=0)
        if name != "SGD":
            base["nesterov"] = False
        if name not in MOMENTUM_OPTIMIZERS and "lr" not in given:
            raise ValueError(f"outer.name={name}: set outer.lr too (the base's lr {base['lr']} is for SGD)")
    return dataclasses.replace(section, **{**base, **given})


def section_of(step: OuterConfig) -> OuterSection:
    """The resolved section of an outer step (every field set)."""
    return OuterSection(**{k: getattr(step, k) for k in (*STEP_KEYS, "period", "kwargs")})


def outer_config(section: OuterSection) -> OuterConfig:
    """The outer step of a resolved section (``resolve_outer``)."""
    missing = [k for k in STEP_KEYS if getattr(section, k) is None]
    if missing:
        raise ValueError(f"outer.{missing[0]} is not resolved (resolve_outer first)")
    return OuterConfig(**{k: getattr(section, k) for k in (*STEP_KEYS, "period", "kwargs")})
