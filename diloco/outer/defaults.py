"""The outer step a run gets when it does not choose one (``outer.auto``, on by default).

For the dense codecs (whose measured best is DiLoCo's Nesterov SGD), a run that sets none of
``outer.name``, ``lr``, ``momentum``, ``nesterov`` and ``momentum_warmup`` gets

    lr = AUTO_LR, momentum = AUTO_MOMENTUM, momentum_warmup = min(AUTO_MOMENTUM_WARMUP, rounds)

(Nesterov SGD), from AUTO_DECAY_FROM rounds on a cosine lr decay to AUTO_LR_MIN_RATIO × lr
over the run (shorter runs: no lr schedule), and the last round an average (``final_average``:
θ − mean Δ in place of the outer step, unless the run sets ``outer.final_average``). The constants and the sweeps behind them:
docs/outer.md.
A run that sets any of those keys (or ``lr_decay``, ``lr_min_ratio``), or ``outer.auto=false``, gets exactly what it wrote, the
codec's best filling the rest (Nesterov SGD, lr 0.7, momentum 0.9 for dense codecs).
"""

from __future__ import annotations

from typing import Any

AUTO_LR = 1.0
AUTO_MOMENTUM = 0.9
AUTO_MOMENTUM_WARMUP = 10  # rounds
AUTO_DECAY_FROM = 60  # rounds: runs this long or longer get the lr decay (at 30 it hurt: docs/outer.md)
AUTO_LR_MIN_RATIO = 0.1  # the decay ends at this share of lr
AUTO_FINAL_AVERAGE = True  # the last round averages: −0.3 to −0.6% bpb at 10 and 30 rounds, both corpora (docs/outer.md)
# Setting any of these turns the rule off.
RULE_KEYS = ("name", "lr", "momentum", "nesterov", "momentum_warmup", "lr_decay", "lr_min_ratio")


def auto_outer(rounds: int) -> dict[str, Any]:
    """The outer settings the rule gives a run of ``rounds`` rounds."""
    rounds = max(int(rounds), 0)
    rule: dict[str, Any] = {"lr": AUTO_LR, "momentum": AUTO_MOMENTUM, "momentum_warmup": min(AUTO_MOMENTUM_WARMUP, rounds), "final_average": AUTO_FINAL_AVERAGE}
    if rounds >= AUTO_DECAY_FROM:
        rule.update(lr_decay="cosine", lr_min_ratio=AUTO_LR_MIN_RATIO)
    return rule


def applies(auto: bool, codec_best: dict[str, Any], given: dict[str, Any]) -> bool:
    """The rule is in force: ``outer.auto`` on, a codec whose best outer step is the default
    Nesterov SGD (no settings of its own), and none of RULE_KEYS set by the run."""
    return bool(auto) and not codec_best and not (set(given) & set(RULE_KEYS))
