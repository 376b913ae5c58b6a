"""The simulation's own config sections (``sim``, ``faults``, ``wan``/``site_wan``, ``metrics``,
``status``) and what would make a process fail at start: each checked before any process
starts, a ConfigError naming the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.app.config import ConfigError, RunConfig
from diloco.coordinator.init_file import load_init_file
from diloco.fields import setting
from diloco.model import build_model, is_builtin, load_parallelize
from diloco.observe.config import check_port
from diloco.observe.prom import check_port_free
from diloco.outer.fragments import split_fragments
from diloco.sim.faults import FaultsConfig
from diloco.sim.links import WanPlan, wan_plan
from diloco.site.device import resolve_device
from diloco.wire.fingerprint import fingerprint, mismatches


@dataclass(frozen=True)
class SimOptions:
    """diloco-sim's own keys (conf/sim.yaml's ``sim:``)."""

    timeout_s: float = setting(3600.0, doc="stop everything and fail if the run takes longer")
    resume: bool = setting(False, doc="go on with the stopped run in hydra.run.dir (the same config) from its checkpoints")
    credentials: bool = setting(
        True, doc="make the run's credentials (a run CA, certificates, tokens) in <run dir>/credentials unless security.dir is set; false: plaintext"
    )
    plots: bool = setting(True, doc="at the end, plots into <run dir>/plots: loss against tokens and bytes, a timeline of rounds per site")
    fork: bool = setting(
        True,
        doc="start the processes by forking a warm process that imported torch once (CPU runs: the same bits, ~3.5 s of CPU less each); false: fresh interpreters",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"sim.{f.name}={value!r}: must be true or false")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"sim.timeout_s={self.timeout_s!r}: must be a number of seconds > 0")


def sim_options(d: Mapping[str, Any] | None) -> SimOptions:
    """The ``sim`` section; ConfigError naming an unknown key or a bad value."""
    d = dict(d or {})
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(SimOptions)})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('sim.' + k for k in unknown)}")
    try:
        return SimOptions(**d)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def sim_coordinator(d: Mapping[str, Any] | None, cfg: RunConfig) -> int:
    """The ``coordinator`` section (the coordinator's keys diloco-sim passes on: ``shards``);
    ConfigError naming an unknown key or a bad value: a cut the model cannot take (more
    shards than tensors) or this machine cannot (no compiled loops), before any process starts."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"shards"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('coordinator.' + k for k in unknown)}; known: shards")
    shards = d.get("shards", 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ConfigError(f"coordinator.shards={shards!r}: must be an integer >= 1")
    if shards > 1 and cfg.mode == "diloco":
        from diloco.coordinator import kernels
        from diloco.coordinator.ranges import split_ranges

        if kernels.native is None:
            raise ConfigError(f"coordinator.shards={shards}: the cut needs the compiled loops (pip install -e . with a C compiler); set coordinator.shards=1")
        try:
            split_ranges({n: tuple(p.shape) for n, p in build_model(cfg.model, cfg.seed).named_parameters()}, shards)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return shards


def sim_faults(d: Mapping[str, Any] | None, cfg: RunConfig) -> FaultsConfig:
    """The ``faults`` section (plain data) of a simulation of ``cfg``; ConfigError naming the
    event and key that cannot work."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"events"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('faults.' + k for k in unknown)}; known: events")
    try:
        faults = FaultsConfig(events=tuple(d.get("events") or ()))
        faults.check_against(cfg.sites, cfg.sync_rounds)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return faults


def sim_wan(wan: Mapping[str, Any] | None, site_wan: Any, cfg: RunConfig) -> WanPlan | None:
    """The ``wan`` and ``site_wan`` sections of a simulation of ``cfg``; ConfigError naming the field."""
    try:
        plan = wan_plan(wan, site_wan, cfg.sites)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if plan is not None and cfg.mode != "diloco":
        raise ConfigError(f"wan: emulated links sit between the sites and the coordinator; mode={cfg.mode} has no coordinator")
    return plan


def sim_metrics(d: Mapping[str, Any] | None, cfg: RunConfig) -> int | None:
    """The ``metrics`` section of a simulation: the coordinator's /metrics port (0: any free
    one; None: no process serves /metrics; the baselines have none). ConfigError naming the
    field; a port something listens on already is refused here, before any process starts."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"port"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('metrics.' + k for k in unknown)}; known: port")
    port = d.get("port")
    try:
        check_port(port, "metrics.port")
        if port:
            check_port_free("127.0.0.1", port)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return port if cfg.mode == "diloco" else None


def sim_status(d: Mapping[str, Any] | None, cfg: RunConfig) -> int | None:
    """The ``status`` section of a simulation: the port of the coordinator's status page (0: any
    free one; None: none; the baselines have none). ConfigError naming the field; a port in
    use is refused here, before any process starts."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"port"})
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join('status.' + k for k in unknown)}; known: port")
    port = d.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"status.port={port!r}: must be null (no status page), 0 (any free port) or a port in 1..65535")
    try:
        if port:
            check_port_free("127.0.0.1", port, field="status.port")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return port if cfg.mode == "diloco" else None


def check_before_start(cfg: RunConfig) -> None:
    """What would make a process fail at start, found before any starts (ConfigError naming
    the field or the file): no GPU for device=cuda, a model factory that does not build, a
    model.parallelize that does not import, an init file that does not load or does not fit
    the model the sites build."""
    try:
        resolve_device(cfg.device)
        load_parallelize(cfg.model)
        if cfg.init.source == "file" or not is_builtin(cfg.model) or cfg.sync.fragments > 1:
            model = build_model(cfg.model, cfg.seed)
            if cfg.sync.fragments > 1:
                split_fragments({n: p.shape for n, p in model.named_parameters()}, cfg.sync.fragments, cfg.sync.split)
            if cfg.init.source == "file":
                problems = mismatches(fingerprint(load_init_file(str(cfg.init.path))), fingerprint(dict(model.named_parameters())).values())
                if problems:
                    raise ConfigError(f"init.path={cfg.init.path}: does not fit model={cfg.model.name}: " + "; ".join(problems))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
