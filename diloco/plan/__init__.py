"""diloco-plan's model: the compute utilization and wall time of a run over given links, and
the bandwidth a target utilization needs, predicted before the run (docs/plan.md).

Pure Python (stdlib only), so the simulation and the command line can both call it without
pulling in torch, grpc or hydra.
"""

from __future__ import annotations

from diloco.plan.coordinator import (
    CODECS,
    MEASURED_COMMIT_S_PER_PARAM,
    MEASURED_GRPC_BYTES_PER_CPU_S,
    MEASURED_INGEST_PARAMS_PER_S,
    NO_COORDINATOR_CPU,
    PLACEMENTS,
)
from diloco.plan.model import (
    MODES,
    OUTER_MODES,
    PAPER_GRID_GBIT,
    TARGETS,
    TOPOLOGIES,
    Plan,
    PlanError,
    Prediction,
    bandwidth_needed,
    bandwidth_table,
    paper_grid_step,
    plan_from_mapping,
    plan_problem,
    plan_report,
    predict,
    run_utilization,
)

__all__ = [
    "CODECS",
    "MEASURED_COMMIT_S_PER_PARAM",
    "MEASURED_GRPC_BYTES_PER_CPU_S",
    "MEASURED_INGEST_PARAMS_PER_S",
    "MODES",
    "NO_COORDINATOR_CPU",
    "OUTER_MODES",
    "PAPER_GRID_GBIT",
    "PLACEMENTS",
    "TARGETS",
    "TOPOLOGIES",
    "Plan",
    "PlanError",
    "Prediction",
    "bandwidth_needed",
    "bandwidth_table",
    "paper_grid_step",
    "plan_from_mapping",
    "plan_problem",
    "plan_report",
    "predict",
    "run_utilization",
]
