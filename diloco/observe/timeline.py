"""What happened to each site in each round, from a run's records.

Per (site, round) a state: ``pushed`` (its push counted: metrics ``participants``),
``evicted`` (its lease ran out while the round was open), ``absent`` (active, but the round
closed without its push), or nothing (not in the run then). On top, events:

- ``late``: its push for the round came after the round closed and was merged into a later one
  (metrics ``merged``: {site, round} in the line of the round it was merged into);
- ``dropped``: its push for the round came late and was refused (metrics ``late``, and the
  site's own ``dropped_rounds`` in workers/<site>.json);
- ``refused``: the norm bound refused its push (metrics ``refused``);
- ``withheld``: the site had no Δ for the round and said so (metrics ``withheld``);
- ``killed``: an injected kill_site fired in the round (summary.json ``faults_injected``);
  the coordinator gets a row of its own when it was killed;
- ``rejoined``: its first push after being killed or evicted;
- ``fault``: another injected fault began there (slow_site, partition_site, drop_push, poison_push).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.observe.rundata import RunData

STATES = ("pushed", "absent", "evicted")
EVENTS = ("late", "dropped", "refused", "withheld", "killed", "rejoined", "fault")
COORDINATOR = "coordinator"


@dataclass
class Timeline:
    rows: list[str]  # site ids, then "coordinator" if it has events
    rounds: list[int]
    states: dict[tuple[str, int], str] = field(default_factory=dict)
    events: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    kill_phase: dict[tuple[str, int], str] = field(default_factory=dict)  # (site, round) -> the phase it was killed in

    def add(self, row: str, round: int, event: str) -> None:
        kinds = self.events.setdefault((row, round), [])
        if event not in kinds:
            kinds.append(event)

    def count(self, event: str) -> int:
        return sum(event in kinds for kinds in self.events.values()) if event in EVENTS else sum(s == event for s in self.states.values())


def _site_of(fault: dict) -> str | None:
    if fault.get("site") is not None:
        return str(fault["site"])
    process = str(fault.get("process", ""))
    return process.split(" ", 1)[1] if process.startswith("site ") else None


def timeline(run: RunData) -> Timeline:
    rounds = [int(m["round"]) for m in run.metrics]
    t = Timeline(rows=list(run.site_ids), rounds=rounds)
    for m in run.metrics:
        r = int(m["round"])
        for s in m.get("absent", []):
            t.states[(str(s), r)] = "absent"
        for s in m.get("evicted", []):
            t.states[(str(s), r)] = "evicted"
        for s in m.get("participants", []):
            t.states[(str(s), r)] = "pushed"
        for p in m.get("merged", []):
            t.add(str(p["site"]), int(p.get("round", r)), "late")
        for p in m.get("late", []):
            t.add(str(p["site"]), int(p.get("round", r)), "dropped")
        for p in m.get("refused") or []:
            t.add(str(p["site"]), int(p.get("round", r)), "refused")
        for p in m.get("withheld") or []:
            t.add(str(p["site"]), int(p.get("round", r)), "withheld")
    known = set(rounds)
    for site, w in run.workers.items():
        for r in w.get("dropped_rounds") or []:
            if int(r) in known:
                t.add(str(site), int(r), "dropped")
    for f in run.faults:
        if f.get("round") is None:
            continue
        r = int(f["round"])
        if f.get("kind") == "kill_coordinator":
            t.add(COORDINATOR, r, "killed")
        elif f.get("kind") == "kill_site" and _site_of(f) is not None:
            t.add(str(_site_of(f)), r, "killed")
            t.kill_phase[(str(_site_of(f)), r)] = str(f.get("phase", ""))
        elif _site_of(f) is not None:
            t.add(str(_site_of(f)), r, "fault")
    _rejoins(t)
    if any(row == COORDINATOR for row, _ in t.events):
        t.rows.append(COORDINATOR)
    t.rows += sorted({row for row, _ in t.events} - set(t.rows))
    return t


def _rejoins(t: Timeline) -> None:
    """Marks each site's first push (counted, merged or dropped) after a kill or an eviction.
    A site killed in a round's inner phase or push and started again pushes that same round."""
    for site in list(t.rows):
        away = False
        for r in t.rounds:
            events = t.events.get((site, r), [])
            pushed = t.states.get((site, r)) == "pushed" or "late" in events or "dropped" in events
            killed_before_push = "killed" in events and t.kill_phase.get((site, r)) in ("inner", "push")
            if (away or killed_before_push) and pushed:
                t.add(site, r, "rejoined")
                away = False
            elif killed_before_push:
                away = True
            if ("killed" in events and not killed_before_push) or t.states.get((site, r)) == "evicted":
                away = True
