"""Entry point of one simulated process: ``python -m diloco.sim.child ROLE --config FILE ...``.

The simulator writes the resolved RunConfig to JSON once and starts every process with it,
so all processes agree on the math by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from diloco.app.config import run_config_from_dict
from diloco.io import exit_process
from diloco.observe.config import MetricsConfig
from diloco.observe.logs import setup_logging
from diloco.observe.status_page import StatusConfig
from diloco.run_dir import RunDir
from diloco.sim.faults import FaultPlan, SiteFaults, coordinator_hooks, faults_from_file
from diloco.site.device import flush_denormals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diloco.sim.child")
    p.add_argument("role", choices=["coordinator", "site", "worker"])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--site-id", default="0")
    p.add_argument("--coordinator", default="127.0.0.1:0")
    p.add_argument("--coordinator-port-file", help="site: connect to the port the coordinator writes there (it starts meanwhile)")
    p.add_argument("--port-file")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--init-file", type=Path)
    p.add_argument("--port", type=int, default=0, help="coordinator: the port to listen on (0: any)")
    p.add_argument("--checkpoint-dir", help="checkpoint every round there, resume from it")
    p.add_argument("--incarnation", type=int, default=0, help="how many times this process was started again")
    p.add_argument("--skip-faults", default="", help="indices of fault events that fired already")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0: any free one)")
    p.add_argument("--metrics-file", help="with --metrics-port: write where /metrics is served there (JSON)")
    p.add_argument("--status-port", type=int, default=None, help="coordinator: serve the status page on this port (0: any free one)")
    p.add_argument("--status-file", help="with --status-port: write where the status page is served there (JSON)")
    p.add_argument("--shards", type=int, default=1, help="coordinator: coordinator.shards (its parameters cut into this many ranges)")
    p.add_argument("--sites-done-file", help="coordinator: after the last round, stop waiting for sites once this file exists")
    args = p.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank started by torchrun for the simulator: die with torchrun, as torchrun dies
        # with the simulator, so that no rank outlives a killed run.
        from diloco.sim.zygote import die_with_parent

        die_with_parent()
    cfg = run_config_from_dict(json.loads(args.config.read_text()))
    flush_denormals(cfg.inner.flush_denormal)  # the process's setting, before its threads start
    process = {"coordinator": "coordinator", "site": f"site {args.site_id}", "worker": f"rank {args.rank}"}[args.role]
    skip = [int(i) for i in args.skip_faults.split(",") if i]
    faults_file = RunDir(args.run_dir).faults
    events = faults_from_file(faults_file).events if faults_file.exists() else ()
    plan = FaultPlan(events, args.run_dir, process, skip) if events else None

    rank = int(os.environ.get("RANK", "0"))  # a rank of a torchrun group (a site of several ranks)
    log = setup_logging(process if rank == 0 or args.role != "site" else f"{process} rank {rank}", json=cfg.logging.json)
    metrics = MetricsConfig(port=args.metrics_port, port_file=args.metrics_file)  # 127.0.0.1; port None: no /metrics
    if args.role == "coordinator":
        from diloco.app.coordinator import CoordinatorOptions, run_coordinator

        opts = CoordinatorOptions(
            host="127.0.0.1", port=args.port, port_file=args.port_file, checkpoint_dir=args.checkpoint_dir, metrics=metrics,
            status=StatusConfig(port=args.status_port, port_file=args.status_file),  # 127.0.0.1; port None: no page
            sites_done_file=args.sites_done_file, shards=args.shards,
        )  # fmt: skip
        run_coordinator(cfg, opts, args.run_dir, log=log, attach=coordinator_hooks(plan) if plan else None)
    elif args.role == "site":
        from diloco.app.site import SiteOptions, run_site
        from diloco.sync import SHARED

        # A site of several ranks: faults are injected into its leader (rank 0); a killed rank
        # takes its torchrun group down with it, and the simulator starts the group again.
        leader = rank == 0
        faults = SiteFaults(plan, int(args.site_id), seed=cfg.seed, incarnation=args.incarnation) if plan and leader else None
        # device=cuda: the simulated sites take the visible GPUs in turn (several may share one).
        gpu = int(args.site_id) if args.site_id.isdigit() else None
        opts = SiteOptions(
            site_id=args.site_id, coordinator=args.coordinator, coordinator_port_file=args.coordinator_port_file, incarnation=args.incarnation,
            checkpoint_dir=args.checkpoint_dir, gpu=gpu, metrics=metrics,
            stated=SHARED,  # every process of a simulation has the whole run config: the site states all of it
        )  # fmt: skip
        run_site(cfg, opts, args.run_dir, log=log, hooks=faults)
    else:
        from diloco.app.baseline import run_data_parallel

        run_data_parallel(cfg, rank=args.rank, world_size=args.world_size, init_file=args.init_file, run_dir=args.run_dir, log=log)
    exit_process()  # every process of the simulation ends as soon as its results are written
    return 0


if __name__ == "__main__":
    sys.exit(main())
