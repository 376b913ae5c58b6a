"""Turning a hydra config into typed configs, and reporting config errors before any work."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from diloco.app.config import ConfigError, RunConfig, renamed_problem, run_config_from_dict
from diloco.observe.config import MetricsConfig, metrics_config
from diloco.observe.progress import ProgressConfig, progress_config
from diloco.observe.status_page import StatusConfig, status_config
from diloco.sync import SHARED

RUN_KEYS = tuple(f.name for f in dataclasses.fields(RunConfig))  # the run's own top-level keys: every RunConfig field


# Each entry point's own top-level keys, besides the run's (RUN_KEYS).
SECTIONS = {
    "sim": ("sim", "coordinator", "faults", "wan", "site_wan", "metrics", "status", "progress"),
    "coordinator": ("coordinator", "metrics", "status"),
    "site": ("site", "metrics", "progress"),
}


def run_config(cfg: DictConfig, sections: tuple[str, ...]) -> RunConfig:
    """The RunConfig of a hydra config whose other top-level keys must be in ``sections``."""
    plain: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    unknown = sorted(set(plain) - set(RUN_KEYS) - set(sections))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return run_config_from_dict({k: plain[k] for k in RUN_KEYS if k in plain})


def section(cfg: DictConfig, name: str) -> dict[str, Any]:
    return OmegaConf.to_container(cfg[name], resolve=True)  # type: ignore[return-value]


def process_metrics(cfg: DictConfig) -> MetricsConfig:
    """The process's ``metrics`` section (its Prometheus endpoint); ConfigError naming the field."""
    try:
        return metrics_config(section(cfg, "metrics") if cfg.get("metrics") is not None else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def process_status(cfg: DictConfig) -> StatusConfig:
    """The coordinator's ``status`` section (its status page); ConfigError naming the field."""
    try:
        return status_config(section(cfg, "status") if cfg.get("status") is not None else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def process_progress(cfg: DictConfig) -> ProgressConfig:
    """The ``progress`` section (live progress on the terminal); ConfigError naming the field."""
    try:
        return progress_config(section(cfg, "progress") if cfg.get("progress") is not None else None)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


# Config groups that set run settings: overriding one states what it sets.
_GROUP_SETTINGS = {"recipe": ("codec", "error_feedback_decay", "outer"), "codec": ("codec",)}


def override_keys(args: list[str]) -> list[str]:
    """The dotted keys a hydra command line sets (``key=value``, ``+key=value``, ``~key``)."""
    return [a.lstrip("+~").split("=", 1)[0] for a in args if "=" in a or a.startswith("~")]


def stated_overrides() -> tuple[str, ...]:
    """The run settings this process's command line sets explicitly (diloco.sync.SHARED's
    keys): what a site states when it joins; it takes the rest from the coordinator."""
    out: list[str] = []
    for key in override_keys(list(HydraConfig.get().overrides.task)):
        if key in _GROUP_SETTINGS:
            out += _GROUP_SETTINGS[key]
        elif key.split(".")[0] in SHARED:
            out.append(key)
    return tuple(dict.fromkeys(out))


def check_renamed(args: list[str]) -> None:
    """Fails at once, naming the new key, for a key of an earlier release on the command line
    (hydra would only say that the key is not in the config)."""
    why = renamed_problem(override_keys(args))
    if why is not None:
        fail(f"bad config: {why}")


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
