"""The planner's coordinator: its shards, where they run, and what its CPU costs per round
(docs/plan.md, "The coordinator"). diloco.plan.model adds these to the links' time.

A coordinator of S shards serves the parameters in S balanced ranges, each range a process of
its own on one core: on hosts of their own (each with a link of ``coordinator_bandwidth_gbit``),
all on one host (its link and ``coordinator_cores`` shared), or one beside each site (S = N,
over the sites' own links). Per round a shard ingests the N sites' pushes of its range (gRPC's
receive, then the decode and the add into the round's sum), commits its range (the outer step,
the downlink's encoding, θ's hash, the checkpoint) and sends N updates of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco.plan.model import Plan

PLACEMENTS = ("hosts", "one_host", "beside_sites")
# conf/codec's codecs (diloco.codec.registry.BASE_NAMES, not imported: the planner is a leaf).
CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "e3m0", "topk2bit")

# The coordinator's CPU, measured on the 2-core AMD EPYC development machine (one core for the
# coordinator process) by scripts/bench_coordinator.py on 2026-12-08 (docs/measurements/coordinator.md):
# re-measure them with that script on the coordinator's own hardware.
# - Ingest once gRPC has the bytes: the server's parse, the checks, and the add into the round's
#   float64 sum, parameters per second of one core per push (`bench_coordinator.py intake`, 50M
#   parameters, medians of 3 runs). fp16 and bf16 were not measured: they are decoded into float32
#   before the add, the path every codec took before issue 37 (~0.2e9 then).
MEASURED_INGEST_PARAMS_PER_S: dict[str, float] = {
    "fp32": 1.05e9, "fp16": 0.2e9, "bf16": 0.2e9, "int8": 1.67e9, "int4": 0.8e9, "e3m0": 0.88e9, "topk2bit": 1.05e9,
}  # fmt: skip
# - Receiving and sending gRPC messages: the bench's loopback ceiling, bytes per CPU-second of the
#   server process (0.598 CPU-s per GB).
MEASURED_GRPC_BYTES_PER_CPU_S = 1.67e9
# - The commit, CPU-seconds per parameter of a shard's range: the outer step, the downlink's
#   encoding and θ's hash (~0.6 s at 100M), and the checkpoint (~2.2 s at 100M: 12 bytes a
#   parameter written, checksummed and synced on this machine's disk), with the round's other fixed
#   work: the intercept of the coordinator's CPU per round against the number of sites (`sites`,
#   100M int8, 1 to 32 sites: 3.7 s).
MEASURED_COMMIT_S_PER_PARAM = 3.7e-8
# A coordinator that costs nothing (the links alone), for a caller whose overhead_s already holds
# the coordinator's measured cost: Plan(..., **NO_COORDINATOR_CPU).
NO_COORDINATOR_CPU: dict[str, float] = {"ingest_params_per_s": math.inf, "grpc_bytes_per_cpu_s": math.inf, "commit_s_per_param": 0.0}


def run_codec(p: Plan) -> str:
    """The uplink codec: ``codec``, or the one ``bits`` names (a block codec's bits include its
    scales': int8 at 8.25 is int8)."""
    if p.codec is not None:
        return p.codec
    return next((name for name, low in (("fp32", 32), ("bf16", 16), ("int8", 8), ("int4", 4)) if p.bits >= low), "topk2bit")


def ingest_rate(p: Plan) -> float:
    """Parameters per second one core ingests with the run's codec."""
    rates = MEASURED_INGEST_PARAMS_PER_S if p.ingest_params_per_s is None else p.ingest_params_per_s
    return float(rates[run_codec(p)] if isinstance(rates, Mapping) else rates)


def coordinator_problem(p: Plan) -> str | None:
    """The coordinator's settings against each other and the topology (each field alone is
    checked with the plan's others); None when they agree."""
    if p.ring:
        for name, value, default in (
            ("shards", p.shards, 1),
            ("shard_placement", p.shard_placement, "hosts"),
            ("coordinator_cores", p.coordinator_cores, None),
        ):
            if value != default:
                return f"{name}={value!r}: {'mode=ddp' if p.mode == 'ddp' else 'topology=allreduce'} exchanges among the sites, with no coordinator to shard"
        return None
    if p.shard_placement == "beside_sites" and p.shards != p.sites:
        return f"shards={p.shards}: shard_placement=beside_sites puts one shard beside each site, so shards must equal sites={p.sites}"
    if p.shard_placement == "beside_sites" and p.coordinator_bandwidth_gbit is not None:
        return (
            f"coordinator_bandwidth_gbit={p.coordinator_bandwidth_gbit!r}: shard_placement=beside_sites serves each shard over its "
            "site's link (bandwidth_gbit); leave it unset"
        )
    if p.coordinator_cores is not None and p.shard_placement != "one_host":
        return (
            f"coordinator_cores={p.coordinator_cores!r}: only shard_placement=one_host shares a host's cores among the shards "
            "(elsewhere each shard has a host and a core of its own)"
        )
    if isinstance(p.ingest_params_per_s, Mapping) and run_codec(p) not in p.ingest_params_per_s:
        whence = "" if p.codec else f", from bits={p.bits:g}"
        return (
            f"ingest_params_per_s has no rate for codec={run_codec(p)} (the run's codec{whence}; it has "
            f"{', '.join(sorted(p.ingest_params_per_s)) or 'none'}): add one, or give one number"
        )
    return None


@dataclass(frozen=True)
class Shards:
    """One shard's costs per parameter of a sync (its range is 1/S of the sync's)."""

    ingest_cpu: float  # CPU-seconds: N pushes of its range, received and summed
    commit_cpu: float  # its range's commit
    send_cpu: float  # N updates of its range, sent
    wall_per_cpu_s: float  # wall seconds per CPU-second: S / cores on one host with fewer cores than shards, else 1
    hosts: int  # coordinator hosts (beside_sites: the sites')
    host_in_bits: float  # bits into one host's link (beside_sites: its site's own with its shard's)
    host_out_bits: float

    @property
    def cpu(self) -> float:
        return self.ingest_cpu + self.commit_cpu + self.send_cpu


NO_SHARDS = Shards(0.0, 0.0, 0.0, 1.0, 0, 0.0, 0.0)


def shards(p: Plan) -> Shards:
    """The shards of ``p``'s coordinator (a ring has none: NO_SHARDS). The links: a shard host
    carries its range from and to every site; one host carries the whole model for every site;
    a shard beside each site carries, like a ring all-reduce, (N-1)/N of a model each way on
    that site's link, together with the site's own push and update (each site's exchange with
    the shard on its own host stays there)."""
    if p.ring:
        return NO_SHARDS
    n, s = p.sites, p.shards
    up, down = float(p.bits), float(p.bits if p.down_bits is None else p.down_bits)
    ingest = n / s * (up / 8 / p.grpc_bytes_per_cpu_s + 1.0 / ingest_rate(p))
    commit = p.commit_s_per_param / s
    send = n / s * down / 8 / p.grpc_bytes_per_cpu_s
    if p.shard_placement == "hosts":
        return Shards(ingest, commit, send, 1.0, s, n / s * up, n / s * down)
    if p.shard_placement == "one_host":
        cores = s if p.coordinator_cores is None else p.coordinator_cores
        return Shards(ingest, commit, send, s / min(s, cores), 1, n * up, n * down)
    both = (n - 1) / n * (up + down)
    return Shards(ingest, commit, send, 1.0, n, both, both)
