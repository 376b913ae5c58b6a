"""diloco-plan: before a run, the compute utilization and wall time per round it will get over
given links, and the bandwidth 50/80/90/95/99% utilization needs (docs/plan.md).

    diloco-plan params=1e9 step_s=0.1 sync_every=100 bits=4 fragments=4 overlap_steps=5 sites=4 bandwidth_gbit=1 rtt_ms=100
    diloco-plan --json mode=ddp topology=allreduce sites=2 bits=16 layers=24 rtt_ms=0
    diloco-plan params=1e10 step_s=0.8 sites=16 bits=8.25 bandwidth_gbit=25 shards=16 shard_placement=beside_sites

Overrides are hydra's (conf/plan.yaml holds every key and its default); ``--json`` prints one
JSON object instead of the table. A bad value exits with status 2 naming the field, as the
other entry points do.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from diloco.plan.model import Plan, PlanError, plan_from_mapping, plan_report

JSON_FLAG = "--json"


def fail(message: str, code: int = 2) -> NoReturn:
    """diloco.cli.common.fail's report and status, repeated here because importing that module
    pulls in torch, which a planner has no use for."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def split_args(argv: Sequence[str]) -> tuple[list[str], bool]:
    """The hydra overrides, and whether ``--json`` was among the arguments (hydra would take it
    for an override and refuse it)."""
    overrides = [a for a in argv if a != JSON_FLAG]
    return overrides, len(overrides) != len(argv)


def load_plan(overrides: Sequence[str]) -> Plan:
    """conf/plan.yaml with the overrides, as a checked Plan; a bad key or value ends the process."""
    try:
        with initialize_config_module(config_module="diloco.conf", version_base=None):
            cfg = compose("plan", overrides=list(overrides))
        values: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as e:
        fail(f"bad config: {e}")
    try:
        return plan_from_mapping(values)
    except PlanError as e:
        fail(f"bad config: {e}")


# ---- the table ---------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _gbit(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v == float("inf"):
        return "inf"
    return f"{v:.3g}" if v >= 0.001 else f"{v:.2e}"


def _header(p: Plan) -> str:
    topology = "ring all-reduce" if p.mode == "ddp" else p.topology
    what = f"mode={p.mode} topology={topology} sites={p.sites} params={p.params:.3g}"
    if p.mode == "diloco":
        what += f" H={p.sync_every} fragments={p.fragments} overlap_steps={p.overlap_steps} outer_mode={p.outer_mode}"
    if not p.ring and (p.shards > 1 or p.shard_placement != "hosts"):
        what += f" shards={p.shards} shard_placement={p.shard_placement}"
    return f"diloco-plan: {what}"


def _straggle_s(p: Plan, r: dict[str, Any]) -> float:
    """The wait for the slowest site, per sync (the model's straggle: outside sync_s)."""
    return p.straggle * r["step_s"] * r["steps_per_round"] / r["syncs_per_round"] + p.straggle_s


def _link_line(p: Plan, r: dict[str, Any]) -> str:
    rate = r["rate_gbit"]
    return f"{_gbit(rate)} Gbit/s per site, set by {r['bottleneck']}; {p.rtt_ms:g} ms RTT"


def _where(p: Plan, r: dict[str, Any]) -> str:
    if p.shard_placement == "one_host":
        cores = p.shards if p.coordinator_cores is None else p.coordinator_cores
        return f"on one host ({cores} core{'s' if cores > 1 else ''})"
    return "beside the sites" if p.shard_placement == "beside_sites" else f"on {r['coordinator_hosts']} host(s)"


def coordinator_rows(p: Plan, r: dict[str, Any]) -> list[tuple[str, str]]:
    """The coordinator's shards: each one's CPU per round, a host link's bytes, what bounds a sync."""
    hosts = "on each site's link (the site's own traffic with its shard's)" if p.shard_placement == "beside_sites" else "per coordinator host"
    parts = {"site link": r["site_link_s"], "shard link": r["shard_link_s"], "shard CPU": r["cpu_s"]}
    return [
        (
            "coordinator",
            f"{r['shards']} shard(s) {_where(p, r)}: {r['shard_cpu_s_per_round']:.4g} CPU-s per shard per round = "
            f"{r['shard_ingest_cpu_s_per_round']:.4g} ingest + {r['shard_commit_cpu_s_per_round']:.4g} commit + {r['shard_send_cpu_s_per_round']:.4g} send",
        ),
        (
            "host link",
            f"{_bytes(r['host_bytes_in_per_round'])} in, {_bytes(r['host_bytes_out_per_round'])} out per round {hosts}; "
            f"{_gbit(r['host_mean_gbit'])} Gbit/s on average",
        ),
        ("bound by", f"{r['sync_bottleneck']}: per sync " + ", ".join(f"{k} {v:.4g} s" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))),
    ]


def _layer_note(p: Plan) -> str:
    return " (and through the backward pass, layer by layer)" if p.per_layer else ""


def table(p: Plan, r: dict[str, Any]) -> str:
    """The report as a few aligned lines, then the bandwidth each target needs."""
    down = p.bits if p.down_bits is None else p.down_bits
    share = "the whole model" if r["syncs_per_round"] == 1 else f"1/{r['syncs_per_round']} of the model"
    rows = [
        ("step", f"{r['step_s']:.4g} s of compute"),
        (
            "round",
            f"{r['steps_per_round']} steps, {r['syncs_per_round']} sync(s): {r['compute_s']:.4g} s compute + {r['stall_s']:.4g} s stall = {r['round_s']:.4g} s",
        ),
        ("utilization", f"{100 * r['utilization']:.1f}%"),
        ("per sync", f"{_bytes(r['payload_bytes_up'])} up, {_bytes(r['payload_bytes_down'])} down ({share} at {p.bits:g}/{down:g} bits per value)"),
        ("link", _link_line(p, r)),
        (
            "one sync",
            f"{r['sync_s']:.4g} s = {r['latency_s']:.4g} s latency + {r['transfer_s']:.4g} s transfer + {p.overhead_s:.4g} s overhead"
            + ("" if p.ring else f" + {r['cpu_s']:.4g} s coordinator CPU")
            + (f", then {_straggle_s(p, r):.4g} s waiting for the slowest site" if p.straggle or p.straggle_s else ""),
        ),
        ("hidden", f"a sync may run {r['hidden_s']:.4g} s past its step{_layer_note(p)} before a site waits"),
        (
            "traffic",
            f"{_bytes(r['sent_bytes_per_round'])} sent, {_bytes(r['received_bytes_per_round'])} received per site per round; {_gbit(r['mean_gbit'])} Gbit/s on average",
        ),
    ]
    if not p.ring:
        rows += coordinator_rows(p, r)
    lines = [_header(p)] + [f"  {k:<12} {v}" for k, v in rows]
    needed = r["bandwidth_needed_gbit"]
    if p.ring or p.coordinator_bandwidth_gbit is not None:
        whose = "every site's link"
    elif p.shard_placement == "beside_sites":
        whose = "every site's link (its shard's traffic with it)"
    else:
        whose = "every link (the coordinator's follows the sites')"
    lines += ["", f"bandwidth needed on {whose}, everything else as above (Gbit/s):"]
    lines.append("  utilization " + "".join(f"{k + '%':>10}" for k in needed))
    lines.append("  Gbit/s      " + "".join(f"{_gbit(v):>10}" for v in needed.values()))
    if None in needed.values():
        lines.append("  (n/a: no bandwidth reaches it: latency, overhead, the coordinator's CPU or its fixed link alone keep it below)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    overrides, as_json = split_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__.strip())
        return
    p = load_plan(overrides)
    report = plan_report(p)
    print(json.dumps(report, indent=1) if as_json else table(p, report), flush=True)


if __name__ == "__main__":
    main()
