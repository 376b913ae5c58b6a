"""diloco-sim's emulated wide-area links: the ``wan`` and ``site_wan`` config sections, turned
into one ``LinkSpec`` per site (and the coordinator's shared link) for the WAN emulator
(diloco/sim/wan.py), which the simulation runs as a process of its own between the sites and
the coordinator, on the real gRPC byte streams."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.sim.wan import LinkSpec

WAN_KEYS = ("bandwidth_mbit", "up_mbit", "down_mbit", "rtt_ms", "jitter_ms", "window_kb")


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
