"""diloco-sim: one command runs a whole multi-site DiLoCo run (or a baseline) on this machine."""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.app.config import ConfigError
from diloco.cli.common import SECTIONS, check_renamed, fail, process_progress, run_config, run_dir, section
from diloco.data import DataError
from diloco.io import exit_process
from diloco.observe.logs import setup_logging
from diloco.sim.launcher import SimError, run_simulation
from diloco.sim.sections import sim_coordinator, sim_faults, sim_metrics, sim_options, sim_status, sim_wan


@hydra.main(config_path="pkg://diloco.conf", config_name="sim", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        rc = run_config(cfg, SECTIONS["sim"])
        sim = sim_options(section(cfg, "sim"))
        shards = sim_coordinator(section(cfg, "coordinator") if cfg.get("coordinator") is not None else None, rc)
        faults = sim_faults(section(cfg, "faults"), rc)
        metrics_port = sim_metrics(section(cfg, "metrics") if cfg.get("metrics") is not None else None, rc)
        status_port = sim_status(section(cfg, "status") if cfg.get("status") is not None else None, rc)
        live = process_progress(cfg)
        wan = sim_wan(section(cfg, "wan"), OmegaConf.to_container(cfg.site_wan, resolve=True) if cfg.get("site_wan") is not None else None, rc)
    except ConfigError as e:
        fail(f"bad config: {e}")
    out = run_dir()
    log = setup_logging("diloco-sim", json=rc.logging.json)
    log(f"diloco-sim: mode={rc.mode} workers={rc.workers} model={rc.model.name} H={rc.sync.every} rounds={rc.rounds} -> {out}")
    try:
        summary = run_simulation(
            rc, out, timeout_s=float(sim.timeout_s), progress=log, resume=sim.resume, faults=faults, credentials=sim.credentials, wan=wan,
            plots=sim.plots, metrics_port=metrics_port, status_port=status_port, live=live, fork=sim.fork, coordinator_shards=shards,
        )  # fmt: skip
    except DataError as e:
        fail(f"bad data: {e}")
    except ConfigError as e:
        fail(f"bad config: {e}")
    except SimError as e:
        fail(f"run failed: {e}", code=1)
    keys = ("mode", "sites", "params", "tokens", "final_eval_bpb", "bytes_up", "bytes_down", "wall_s", "hashes_equal")
    # The summary is the command's output, not a log record; logging.json=true: one line, so
    # that stdout holds nothing but JSON lines.
    print(json.dumps({k: summary[k] for k in keys}, indent=None if rc.logging.json else 1), flush=True)
    log(f"results: {out}/summary.json and {out}/metrics.jsonl")
    exit_process()  # skips the interpreter's teardown (half a second or more with torch loaded)


def main() -> None:
    check_renamed(sys.argv[1:])  # before hydra, which would only say the key is unknown
    _main()


if __name__ == "__main__":
    main()
