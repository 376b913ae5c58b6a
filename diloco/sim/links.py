"""diloco-sim's emulated wide-area links: the ``wan`` and ``site_wan`` config sections, turned
into one ``LinkSpec`` per site (and the coordinator's shared link) for the WAN emulator
(diloco/sim/wan.py), which the simulation runs as a process of its own between the sites and
the coordinator, on the real gRPC byte streams."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.fields import setting

WAN_KEYS = ("bandwidth_mbit", "up_mbit", "down_mbit", "rtt_ms", "jitter_ms", "window_kb")  # a link's config form


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link. For a site's link, up is site -> coordinator and down is
    coordinator -> site; for the coordinator's shared link, up is what the coordinator sends
    (to every site) and down what it receives (from every site)."""

    up_mbit: float | None = setting(None, doc="bandwidth up, Mbit/s (1e6 bit/s); null: unlimited (bandwidth_mbit sets both directions)")
    down_mbit: float | None = setting(None, doc="bandwidth down, Mbit/s (1e6 bit/s); null: unlimited")
    rtt_ms: float = setting(0.0, doc="round-trip time the link adds, ms: rtt/2 each direction")
    jitter_ms: float = setting(0.0, doc="extra one-way delay per segment, ms, uniform in [0, jitter_ms]; byte order kept")
    # TCP's window: the smaller of the congestion window and the receiver's buffer. A byte is
    # acknowledged one round trip after it left the sender's link.
    window_kb: float | None = setting(
        None, doc="the most bytes (KiB) one connection has sent and not yet acknowledged, per direction: at most window/RTT per connection; null: no limit"
    )

    def problem(self, where: str) -> str | None:
        """What is wrong with this spec, naming the field under ``where``; None if nothing."""
        for name in ("up_mbit", "down_mbit", "window_kb"):
            if (msg := _rate_problem(getattr(self, name), _field(where, name))) is not None:
                return msg
        for name in ("rtt_ms", "jitter_ms"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                return f"{_field(where, name)}={value!r}: must be a finite number >= 0"
        return None

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str) -> LinkSpec:
        """A spec from its config form. ``bandwidth_mbit`` sets both directions; ``up_mbit`` or
        ``down_mbit``, if also given, override it for theirs. ValueError names the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}={d!r}: must be a mapping with some of {', '.join(WAN_KEYS)}")  # noqa: TRY004 - one error type for a bad config
        unknown = sorted(str(k) for k in d if k not in WAN_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(WAN_KEYS)}")
        both = d.get("bandwidth_mbit")
        if (msg := _rate_problem(both, _field(where, "bandwidth_mbit"))) is not None:
            raise ValueError(msg)
        spec = LinkSpec(
            up_mbit=d.get("up_mbit", both),
            down_mbit=d.get("down_mbit", both),
            rtt_ms=d.get("rtt_ms", 0.0),
            jitter_ms=d.get("jitter_ms", 0.0),
            window_kb=d.get("window_kb"),
        )
        if (msg := spec.problem(where)) is not None:
            raise ValueError(msg)
        as_float = {k: None if v is None else float(v) for k, v in spec.to_dict().items()}
        return LinkSpec(**as_float)

    def to_dict(self) -> dict[str, Any]:
        return {"up_mbit": self.up_mbit, "down_mbit": self.down_mbit, "rtt_ms": self.rtt_ms, "jitter_ms": self.jitter_ms, "window_kb": self.window_kb}


def _field(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rate_problem(value: object, field: str) -> str | None:
    if value is None or (_is_number(value) and math.isfinite(value) and value > 0):  # type: ignore[arg-type]
        return None
    return f"{field}={value!r}: must be a finite number > 0 (or null: unlimited)"


@dataclass(frozen=True)
class WanPlan:
    sites: dict[str, LinkSpec]  # site id -> its link to the coordinator
    coordinator: LinkSpec | None  # the coordinator's own link, shared by every site; None: unlimited

    def to_dict(self) -> dict[str, Any]:
        return {"sites": {s: spec.to_dict() for s, spec in self.sites.items()}, "coordinator": self.coordinator.to_dict() if self.coordinator else None}


def _idle(spec: LinkSpec) -> bool:
    return spec.up_mbit is None and spec.down_mbit is None and spec.rtt_ms == 0 and spec.jitter_ms == 0 and spec.window_kb is None


def wan_plan(wan: Mapping[str, Any] | None, site_wan: Sequence[Mapping[str, Any] | None] | None, sites: int) -> WanPlan | None:
    """The links of a run of ``sites`` sites: ``wan`` for every site (with ``wan.coordinator``
    for the coordinator's link), each entry of ``site_wan`` (one per site) overriding it for
    its site. None when nothing is emulated. ValueError naming the field."""
    wan = dict(wan or {})
    coordinator = wan.pop("coordinator", None)
    unknown = sorted(set(wan) - set(WAN_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join('wan.' + k for k in unknown)}; known: {', '.join(WAN_KEYS)}, coordinator")
    base = {k: v for k, v in wan.items() if v is not None}
    if site_wan is not None and (isinstance(site_wan, (str, bytes, Mapping)) or len(site_wan) != sites):
        raise ValueError(f"site_wan: give a list of one link per site ({sites}), e.g. [{{bandwidth_mbit: 10}}, {{}}, ...]; got {site_wan!r}")
    LinkSpec.from_dict(base, "wan")  # each part checked on its own, so the error names where the value was
    links = {}
    for s in range(sites):
        own = {k: v for k, v in dict(site_wan[s] or {}).items() if v is not None} if site_wan is not None else {}
        LinkSpec.from_dict(own, f"site_wan[{s}]")
        merged = {**base, **own}
        if own.get("bandwidth_mbit") is not None:  # a site's own bandwidth replaces the shared up/down too
            merged = {k: v for k, v in merged.items() if k not in ("up_mbit", "down_mbit") or k in own}
        links[str(s)] = LinkSpec.from_dict(merged, f"site_wan[{s}]" if own else "wan")
    coord = LinkSpec.from_dict({k: v for k, v in dict(coordinator).items() if v is not None}, "wan.coordinator") if coordinator else None
    if all(_idle(spec) for spec in links.values()) and (coord is None or _idle(coord)):
        return None
    return WanPlan(links, coord)
