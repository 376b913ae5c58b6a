"""The settings every site of a run shares, owned by the coordinator.

A site joins saying what it is (its model's fingerprint, whether it can upload θ₀) and the
settings its own configuration states explicitly; the coordinator refuses a site that states
another value than the run's, naming the key, and answers every other site with the run's
``RunSettings``, which the site then uses. So a site needs no more configuration than its
model, its data and the coordinator's address, and ``DiLoCo(...)`` joins any kind of run.

On the wire the settings are plain JSON (``to_dict`` / ``from_dict``): a setting added to
these dataclasses travels without a protocol change. Keys are dotted (``sync.every``,
``codec.name``, ``outer.lr``). ``sync.streams`` is the one setting of the section that stays
a site's own (how many connections its link wants), so it is neither checked nor imposed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.codec import CodecConfig, codec_config
from diloco.outer.defaults import OuterSection, outer_config, resolve_outer
from diloco.outer.eager import check_eager_outer
from diloco.outer.optimizer import OuterConfig
from diloco.security.ids import quote
from diloco.sync.config import SyncConfig
from diloco.sync.schedule import SyncSchedule

# The run settings' sections (RunSettings' fields): a site that states one states all of it.
SHARED = ("rounds", "sync", "codec", "codec_down", "error_feedback", "error_feedback_decay", "outer")
SITE_OWN = ("sync.streams",)  # stated by a site for itself: never refused, never imposed
MAX_SETTINGS_BYTES = 64 * 1024  # the JSON of a site's stated settings, at most


@dataclass(frozen=True)
class RunSettings:
    """What every site of a run must agree on, resolved (no null left)."""

    rounds: int
    sync: SyncConfig
    codec: CodecConfig  # the uplink's encoding of Δ
    codec_down: CodecConfig  # the downlink's encoding of the update (what sites decode)
    error_feedback: bool  # a lossy codec's error carried into the next round (both links)
    error_feedback_decay: float  # β: the share of a site's last uplink residual added to its next Δ
    outer: OuterSection  # the outer step, resolved (a site that looks ahead follows it)

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds={self.rounds!r}: must be an integer >= 1")
        if self.sync.looks_ahead:
            check_eager_outer(self.outer_step, "sync.mode=eager" if self.sync.mode == "eager" else "sync.merge=ahead")

    @staticmethod
    def defaults(rounds: int = 10) -> RunSettings:
        """A run's settings where nothing is set (fp32 both ways, blocking, the measured outer rule)."""
        codec = CodecConfig()
        return RunSettings(rounds, SyncConfig(), codec, codec, True, 1.0, resolve_outer(OuterSection(), rounds, {}))

    @property
    def outer_step(self) -> OuterConfig:
        return outer_config(self.outer)

    @property
    def schedule(self) -> SyncSchedule:
        return SyncSchedule.of(self.sync, self.rounds)

    @property
    def total_rounds(self) -> int:
        """The coordinator's rounds: ``rounds`` × F, plus F − 1 flush rounds unless the fragments freeze."""
        return self.schedule.total_rounds(self.rounds)

    @property
    def total_steps(self) -> int:
        """Inner steps per site over the run (rounds × H, less what sync.schedule saves)."""
        steps = self.schedule.total_steps
        assert steps is not None
        return steps

    # ---- on the wire ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able data (enums as their strings) that ``from_dict`` turns back."""
        return _plain(dataclasses.asdict(self))

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RunSettings:
        """ValueError naming the key for anything missing, unknown or invalid."""
        if not isinstance(d, Mapping):
            raise ValueError(f"run settings must be a JSON object, not {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(RunSettings)}
        wrong = sorted(set(d) ^ known)
        if wrong:
            raise ValueError(f"run settings: unknown or missing key(s) {', '.join(wrong)}")
        return RunSettings(
            rounds=d["rounds"],
            sync=_section(SyncConfig, d["sync"], "sync"),
            codec=codec_config(d["codec"]),
            codec_down=codec_config(d["codec_down"]),
            error_feedback=_bool(d["error_feedback"], "error_feedback"),
            error_feedback_decay=float(d["error_feedback_decay"]),
            outer=_section(OuterSection, d["outer"], "outer"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> RunSettings:
        return RunSettings.from_dict(json.loads(text))

    # ---- what a site states ---------------------------------------------------------------
    def flat(self) -> dict[str, Any]:
        """Every setting under its dotted key (``sync.every``, ``codec.name``, ``outer.kwargs``)."""
        return flatten(self.to_dict())

    def stated(self, prefixes: tuple[str, ...]) -> dict[str, Any]:
        """The settings under any of ``prefixes`` (``codec`` takes every ``codec.*``), as a site
        states them at Join: the keys its own configuration set explicitly."""
        return {k: v for k, v in self.flat().items() if any(k == p or k.startswith(p + ".") for p in prefixes)}

    def conflicts(self, stated: Mapping[str, Any]) -> list[str]:
        """What a site states that differs from these settings, as ``key=its value (the run's:
        value)``; an unknown key is a conflict too. Site-own keys (SITE_OWN) never conflict."""
        run = self.flat()
        out = []
        for key, value in sorted(stated.items()):
            if key in SITE_OWN:
                continue
            if key not in run:
                out.append(f"{quote(key, 80)}: not a run setting")
            elif _plain(value) != run[key]:
                out.append(f"{key}={_show(value)[:200]} (the run's: {_show(run[key])})")
        return out


def parse_stated(text: str) -> dict[str, Any]:
    """A site's stated settings from the JSON it sent (``{}`` for none); ValueError saying what
    is wrong with it."""
    if not text:
        return {}
    if len(text) > MAX_SETTINGS_BYTES:
        raise ValueError(f"stated settings of {len(text)} bytes: at most {MAX_SETTINGS_BYTES}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"stated settings are not JSON: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("stated settings must be a JSON object of dotted keys")
    return value


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys; a mapping-valued setting (outer.kwargs) stays whole."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and key != "outer.kwargs":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _plain(value: Any) -> Any:
    """JSON's view of a value: enums as strings, tuples as lists, mappings as dicts."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _show(value: Any) -> str:
    return json.dumps(_plain(value))


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: must be true or false")
    return value


def _section(cls: type, values: object, name: str) -> Any:
    if not isinstance(values, Mapping):
        raise ValueError(f"{name}: must be a mapping of its fields, not {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(name + '.' + k for k in unknown)}")
    return cls(**dict(values))
