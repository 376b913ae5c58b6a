"""diloco-sim: one command runs a whole multi-site DiLoCo run (or a baseline) on this machine."""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from diloco.cli.common import fail, run_config, run_dir, section
from diloco.app.config import ConfigError
from diloco.data import DataError
from diloco.sim.launcher import SimError, run_simulation, sim_faults, sim_wan


@hydra.main(config_path="pkg://diloco.conf", config_name="sim", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        rc = run_config(cfg, ("sim", "faults", "wan", "site_wan"))
        faults = sim_faults(section(cfg, "faults"), rc)
        wan = sim_wan(section(cfg, "wan"), OmegaConf.to_container(cfg.site_wan, resolve=True) if cfg.get("site_wan") is not None else None, rc)
    except ConfigError as e:
        fail(f"bad config: {e}")
    out = run_dir()
    print(f"diloco-sim: mode={rc.mode} workers={rc.workers} model={rc.model.name} H={rc.sync_every} rounds={rc.rounds} -> {out}", flush=True)
    try:
        sim = section(cfg, "sim")
        summary = run_simulation(rc, out, timeout_s=float(sim["timeout_s"]), resume=bool(sim["resume"]), faults=faults, credentials=bool(sim["credentials"]), wan=wan)
    except DataError as e:
        fail(f"bad data: {e}")
    except ConfigError as e:
        fail(f"bad config: {e}")
    except SimError as e:
        fail(f"run failed: {e}", code=1)
    keys = ("mode", "sites", "params", "tokens", "final_eval_bpb", "bytes_up", "bytes_down", "wall_s", "hashes_equal")
    print(json.dumps({k: summary[k] for k in keys}, indent=1), flush=True)
    print(f"results: {out}/summary.json and {out}/metrics.jsonl", flush=True)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
