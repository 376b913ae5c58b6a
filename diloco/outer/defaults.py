"""The outer step a run gets when it does not choose one (``outer.auto``, on by default).

For the dense codecs (whose measured best is DiLoCo's Nesterov SGD), a run that sets none of
``outer.name``, ``lr``, ``momentum``, ``nesterov`` and ``momentum_warmup`` gets

    lr = AUTO_LR, momentum = AUTO_MOMENTUM, momentum_warmup = min(AUTO_MOMENTUM_WARMUP, rounds)

(Nesterov SGD, no lr schedule). The constants and the sweeps behind them: docs/outer.md.
A run that sets any of those keys, or ``outer.auto=false``, gets exactly what it wrote, the
codec's best filling the rest (Nesterov SGD, lr 0.7, momentum 0.9 for dense codecs).
"""

from __future__ import annotations

from typing import Any

AUTO_LR = 1.0
AUTO_MOMENTUM = 0.9
AUTO_MOMENTUM_WARMUP = 10  # rounds
RULE_KEYS = ("name", "lr", "momentum", "nesterov", "momentum_warmup")  # setting any of these turns the rule off


def auto_outer(rounds: int) -> dict[str, Any]:
    """The outer settings the rule gives a run of ``rounds`` rounds."""
    return {"lr": AUTO_LR, "momentum": AUTO_MOMENTUM, "momentum_warmup": min(AUTO_MOMENTUM_WARMUP, max(int(rounds), 0))}


def applies(auto: bool, codec_best: dict[str, Any], given: dict[str, Any]) -> bool:
    """The rule is in force: ``outer.auto`` on, a codec whose best outer step is the default
    Nesterov SGD (no settings of its own), and none of RULE_KEYS set by the run."""
    return bool(auto) and not codec_best and not (set(given) & set(RULE_KEYS))
