"""Fault injection for the simulation: which faults a run suffers, and the hooks that make
them happen inside the real processes.

A process injects its own faults at the exact moment they are meant to happen (a site in
the middle of its push stream, the coordinator right after a commit) and kills itself with a
real SIGKILL; before dying it appends a line to ``<run_dir>/faults.jsonl`` so that the
simulator knows the death was planned and when to start the process again. Each event fires
at most once per run: a restarted process is told which events already fired.

Kinds (``faults.events`` in the run config, a list of mappings):

* ``kill_site``: ``site``, ``at_round``, ``phase`` (``inner``: half-way through the inner
  phase of round at_round; ``push``: after the first chunk of its push was handed to gRPC;
  ``pull``: after its update of round at_round arrived, before it is applied),
  ``restart_after_s`` (default 5; a negative value: never restarted).
* ``kill_coordinator``: ``at_round``, ``phase`` (``between``: right after round at_round was
  committed; ``mid``: when the first push of round at_round arrives), ``restart_after_s``.
* ``slow_site``: ``site``, ``factor`` (> 1): each inner step takes factor times as long
  (the site sleeps (factor - 1) x the step's time after it), from ``at_round`` (default 0).
* ``drop_push``: ``prob``: each push attempt is lost on the way with this probability (the
  site sees the connection fail and sends it again); ``site`` (default: every site);
  ``lost: true``: the pseudo-gradient is lost for good instead (the DiLoCo paper's dropped
  workers): the site withholds its push (PushHeader.withheld says why), the round goes on
  without it, and the site pulls the round's update as usual.
* ``partition_site``: ``site``, ``at_round``, ``seconds``: from the moment the site wants to
  push round at_round, every call it makes fails as if the network were cut, for ``seconds``.
* ``poison_push``: ``site``, ``factor``: from ``at_round`` (default 0) every push of the site
  carries its Δ times factor (a diverged or hostile site; see robust.* for the defences).
* ``diverge_site``: ``site``, ``at_round``: half-way through the inner phase of round at_round
  a NaN appears in the site's parameters (an overflow, a bad batch) and its inner phase
  diverges: the site withholds the round's Δ, restarts from θ with a fresh inner optimizer
  state, and trains on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.codec import get_codec
from diloco.errors import RemoteError
from diloco.io import read_jsonl_tolerant
from diloco.run_dir import RunDir

KINDS = ("kill_site", "kill_coordinator", "slow_site", "drop_push", "partition_site", "poison_push", "diverge_site")
_PHASES = {"kill_site": ("inner", "push", "pull"), "kill_coordinator": ("between", "mid")}
_REQUIRED = {
    "kill_site": ("site", "at_round"),
    "kill_coordinator": ("at_round",),
    "slow_site": ("site", "factor"),
    "drop_push": ("prob",),
    "partition_site": ("site", "at_round", "seconds"),
    "poison_push": ("site", "factor"),
    "diverge_site": ("site", "at_round"),
}
_ALLOWED = {
    "kill_site": ("site", "at_round", "phase", "restart_after_s"),
    "kill_coordinator": ("at_round", "phase", "restart_after_s"),
    "slow_site": ("site", "factor", "at_round"),
    "drop_push": ("prob", "site", "lost"),
    "partition_site": ("site", "at_round", "seconds"),
    "poison_push": ("site", "factor", "at_round"),
    "diverge_site": ("site", "at_round"),
}


@dataclass(frozen=True)
class FaultEvent:
    kind: str
    site: int | None = None
    at_round: int | None = None
    phase: str | None = None
    restart_after_s: float = 5.0
    factor: float = 1.0
    prob: float = 0.0
    seconds: float = 0.0
    lost: bool = False  # drop_push: the pseudo-gradient is lost for good (withheld), not resent

    @property
    def kills(self) -> bool:
        return self.kind in ("kill_site", "kill_coordinator")


def fault_event(d: Mapping[str, Any], index: int = 0) -> FaultEvent:
    """One event from plain data; every problem names the event and the key."""
    where = f"faults.events[{index}]"
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"{where}.kind={kind!r}: must be one of {', '.join(KINDS)}")
    unknown = sorted(set(d) - set(_ALLOWED[kind]))
    if unknown:
        raise ValueError(f"{where}: {kind} takes no {', '.join(unknown)} (it takes {', '.join(_ALLOWED[kind])})")
    missing = [k for k in _REQUIRED[kind] if d.get(k) is None]
    if missing:
        raise ValueError(f"{where}: {kind} needs {', '.join(missing)}")
    for key in ("site", "at_round"):
        if key in d and not (isinstance(d[key], int) and d[key] >= 0):
            raise ValueError(f"{where}.{key}={d[key]!r}: must be an integer >= 0")
    if kind in _PHASES:
        d.setdefault("phase", _PHASES[kind][0])
        if d["phase"] not in _PHASES[kind]:
            raise ValueError(f"{where}.phase={d['phase']!r}: {kind} takes one of {', '.join(_PHASES[kind])}")
    for key in ("restart_after_s", "factor", "prob", "seconds"):
        if key in d and not isinstance(d[key], (int, float)):
            raise ValueError(f"{where}.{key}={d[key]!r}: must be a number")
    if kind == "slow_site" and not d["factor"] >= 1:
        raise ValueError(f"{where}.factor={d['factor']}: must be >= 1")
    if kind == "drop_push" and not 0 <= d["prob"] < 1:
        raise ValueError(f"{where}.prob={d['prob']}: must be in [0, 1)")
    if "lost" in d and not isinstance(d["lost"], bool):
        raise ValueError(f"{where}.lost={d['lost']!r}: must be true or false")
    if kind == "partition_site" and not d["seconds"] > 0:
        raise ValueError(f"{where}.seconds={d['seconds']}: must be > 0")
    return FaultEvent(kind=kind, **d)


def fault_to_dict(e: FaultEvent) -> dict[str, Any]:
    """The plain data ``fault_event`` turns back into ``e`` (only the keys its kind takes)."""
    return {"kind": e.kind, **{k: getattr(e, k) for k in _ALLOWED[e.kind] if getattr(e, k) is not None}}


@dataclass(frozen=True)
class FaultsConfig:
    """The run config's ``faults`` section."""

    events: tuple[FaultEvent, ...] = ()

    def __post_init__(self) -> None:
        events = tuple(e if isinstance(e, FaultEvent) else fault_event(e, i) for i, e in enumerate(self.events or ()))
        object.__setattr__(self, "events", events)

    def check_against(self, sites: int, rounds: int) -> None:
        for i, e in enumerate(self.events):
            if e.site is not None and e.site >= sites:
                raise ValueError(f"faults.events[{i}].site={e.site}: this run has sites 0..{sites - 1}")
            if e.at_round is not None and e.at_round >= rounds:
                raise ValueError(f"faults.events[{i}].at_round={e.at_round}: this run has rounds 0..{rounds - 1}")


def faults_to_dict(f: FaultsConfig) -> dict[str, Any]:
    return {"events": [fault_to_dict(e) for e in f.events]}


def faults_from_file(path: Path) -> FaultsConfig:
    return FaultsConfig(events=tuple(json.loads(path.read_text()).get("events", ())))


# ---- firing ------------------------------------------------------------------------------
def read_fired(run_dir: Path) -> list[dict[str, Any]]:
    """The events that fired so far (a line each; a torn last line of a killed writer is skipped)."""
    return read_jsonl_tolerant(RunDir(run_dir).faults_fired)


class FaultPlan:
    """The events one process must inject, minus those that fired already."""

    def __init__(self, events: Iterable[FaultEvent], run_dir: Path, process: str, skip: Iterable[int] = ()) -> None:
        skipped = set(skip)
        self.events = {i: e for i, e in enumerate(events) if i not in skipped}
        self.run_dir = run_dir
        self.process = process
        self._lock = threading.Lock()

    def record(self, index: int, **details: Any) -> None:
        line = {"event": index, "kind": self.events[index].kind, "process": self.process, "time": time.time(), **details}
        with self._lock, open(RunDir(self.run_dir).faults_fired, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def kill(self, index: int, **details: Any) -> None:
        """Records the event, then SIGKILLs this process (nothing after this runs)."""
        self.record(index, restart_after_s=self.events[index].restart_after_s, **details)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached: SIGKILL cannot be caught


def coordinator_hooks(plan: FaultPlan) -> Callable[[Any], None]:
    """What the simulated coordinator process does with its Coordinator before serving:
    listeners that kill it where its events say (``between``: right after round at_round was
    committed; ``mid``: when the first push of round at_round arrives)."""

    def fire(phase: str, r: int) -> None:
        for i, e in plan.events.items():
            if e.kind == "kill_coordinator" and e.phase == phase and e.at_round == r:
                plan.kill(i, round=r, phase=phase)

    def attach(coordinator: Any) -> None:
        coordinator.on_commit.append(lambda record: fire("between", record.round))
        coordinator.on_push.append(lambda r: fire("mid", r))

    return attach


@dataclass
class SiteFaults:
    """The faults of one site process: hooks its training loop calls, and a client wrapper."""

    plan: FaultPlan
    site: int
    seed: int = 0
    incarnation: int = 0
    _partition_until: float = 0.0
    _rng: random.Random = field(init=False)
    dropped_pushes: int = 0
    _slowed: set[int] = field(default_factory=set)
    _poisoned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.plan.events = {i: e for i, e in self.plan.events.items() if e.site in (None, self.site) and e.kind != "kill_coordinator"}
        self._rng = random.Random(f"{self.seed}/{self.site}/{self.incarnation}")

    def _events(self, kind: str, **match: Any) -> list[tuple[int, FaultEvent]]:
        return [(i, e) for i, e in self.plan.events.items() if e.kind == kind and all(getattr(e, k) == v for k, v in match.items())]

    def after_step(self, round: int, step: int, steps: int, step_s: float) -> None:
        """Called after inner step ``step`` (0-based) of ``steps`` in ``round``."""
        for i, e in self._events("slow_site"):
            if round >= (e.at_round or 0):
                if i not in self._slowed:  # recorded once, when it starts
                    self._slowed.add(i)
                    self.plan.record(i, round=round, site=self.site, factor=e.factor)
                time.sleep((e.factor - 1) * step_s)
        if step == steps // 2:
            for i, _ in self._events("kill_site", at_round=round, phase="inner"):
                self.plan.kill(i, round=round, phase="inner", site=self.site)

    def diverges(self, round: int, step: int, steps: int) -> bool:
        """Whether the site's parameters turn NaN after inner step ``step`` of ``round``
        (diverge_site: half-way through the phase of its at_round, once)."""
        if step != steps // 2:
            return False
        fired = self._events("diverge_site", at_round=round)
        for i, _ in fired:
            self.plan.record(i, round=round, site=self.site)
            del self.plan.events[i]
        return bool(fired)

    def before_push(self, round: int) -> None:
        for i, e in self._events("partition_site", at_round=round):
            self._partition_until = time.monotonic() + e.seconds
            self.plan.record(i, round=round, site=self.site, seconds=e.seconds)
            del self.plan.events[i]

    def wrap(self, client: Any) -> Any:
        return _FaultyClient(client, self)


class _FaultyClient:
    """The site's CoordinatorClient with the faults in the way of its calls."""

    def __init__(self, client: Any, faults: SiteFaults) -> None:
        self._client = client
        self._f = faults

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in ("join", "wait_round", "pull_global", "pull_global_with_state", "heartbeat", "leave"):
            return self._guarded(attr)
        return attr

    def _guarded(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._check_partition()
            return call(*args, **kwargs)

        return guarded

    def _check_partition(self) -> None:
        left = self._f._partition_until - time.monotonic()
        if left > 0:
            time.sleep(min(left, 0.5))  # a cut network fails after a while, not at once
            raise RemoteError("unavailable", f"injected: site {self._f.site} is cut off from the coordinator ({left:.1f}s left)")

    def push(self, header: Any, chunks: Iterable[Any], lane: int = 0) -> Any:
        self._check_partition()
        f = self._f
        for i, e in f._events("drop_push"):
            if f._rng.random() < e.prob:
                f.dropped_pushes += 1
                f.plan.record(i, round=header.round, site=f.site, lost=e.lost)
                if e.lost:  # the site has no Δ to send: it says so, and the round goes on without it
                    why = f"its pseudo-gradient was lost (injected drop_push, prob {e.prob:g})"
                    return self._client.push(dataclasses.replace(header, withheld=why, part=0, parts=1), iter(()), lane=lane)
                raise RemoteError("unavailable", f"injected: push of round {header.round} was lost on the way")
        for i, e in f._events("poison_push"):
            if header.round >= (e.at_round or 0):
                if i not in f._poisoned:  # recorded once, when it starts
                    f._poisoned.add(i)
                    f.plan.record(i, round=header.round, site=f.site, factor=e.factor)
                chunks = [_scaled(c, e.factor) for c in chunks]
        kills = f._events("kill_site", at_round=header.round, phase="push")
        if kills:
            chunks = self._kill_after_first(chunks, kills[0][0], header.round)
        return self._client.push(header, chunks, lane=lane)

    def _kill_after_first(self, chunks: Iterable[Any], index: int, round: int) -> Iterator[Any]:
        it = iter(chunks)
        first = next(it, None)
        if first is not None:
            yield first
        time.sleep(0.2)  # let gRPC put the header and the first chunk on the wire
        self._f.plan.kill(index, round=round, phase="push", site=self._f.site)
        yield from it

    def pull_update(self, site_id: str, round: int, want: Any = None, lane: int = 0, **wait: Any) -> Any:
        self._check_partition()
        return self._pulled(round, self._client.pull_update(site_id, round, want, lane=lane, **wait))

    def start_pull(self, site_id: str, round: int, want: Any = None, lane: int = 0, wait_s: float = 30.0) -> Any:
        self._check_partition()
        return _FaultyPull(self._client.start_pull(site_id, round, want, lane=lane, wait_s=wait_s), self, round)

    def _pulled(self, round: int, chunks: Any) -> Any:
        if chunks is None:
            return None  # still open: no pull yet
        for i, _ in self._f._events("kill_site", at_round=round, phase="pull"):
            self._f.plan.kill(i, round=round, phase="pull", site=self._f.site)
        return chunks


class _FaultyPull:
    """A started pull whose result meets the pull phase's faults."""

    def __init__(self, call: Any, client: _FaultyClient, round: int) -> None:
        self._call, self._client, self._round = call, client, round

    def result(self, on_committed: Any = None) -> Any:
        return self._client._pulled(self._round, self._call.result(on_committed))

    def cancel(self) -> None:
        self._call.cancel()


def _scaled(chunk: Any, factor: float) -> Any:
    """``chunk`` with its values times ``factor``, encoded again with its own codec."""
    codec = get_codec(chunk.codec)
    return dataclasses.replace(chunk, payload=codec.encode(codec.decode(chunk.payload, chunk.numel) * factor))
