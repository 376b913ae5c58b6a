"""The planner's time model: how long a DiLoCo round takes over given links, how much of it the
sites spend computing, and how much bandwidth a target utilization needs (docs/plan.md).

Everything is closed-form arithmetic over a few seconds-long timelines, so a plan is checked in
microseconds and the inverse can simply bisect. Pure stdlib: the simulation and the command line
import it without torch, grpc or hydra.

Time origin of one sync: the end of the inner step whose result it carries. A sync is a list of
pieces (one piece, or one per layer when its all-reduce overlaps the backward pass), each with
the moment it may start, its share of the parameters and the moment the site needs it back;
the link carries the pieces one after another, and the site stalls by the worst lateness.
With a coordinator, a sync also waits for the coordinator's CPU (ingesting the N pushes,
committing, sending the N updates), per shard, the shards working in parallel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from diloco.plan.coordinator import (
    CODECS,
    MEASURED_COMMIT_S_PER_PARAM,
    MEASURED_GRPC_BYTES_PER_CPU_S,
    PLACEMENTS,
    coordinator_problem,
    shards,
)

MODES = ("diloco", "ddp")
TOPOLOGIES = ("coordinator", "allreduce")
OUTER_MODES = ("blocking", "eager", "delayed")
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)

# Streaming DiLoCo's Table 4 (arXiv 2501.18512) reports bandwidths from a log grid: every value
# in it is one of these 50 points, 0.1 to 1000 Gbit/s (numpy.logspace(-1, 3, 50)).
PAPER_GRID_GBIT: tuple[float, ...] = tuple(10 ** (-1 + 4 * k / 49) for k in range(50))

# The inverse searches between these; below MIN_GBIT a plan needs no bandwidth worth naming,
# above MAX_GBIT (a petabit per second) a target counts as unreachable.
MIN_GBIT = 1e-9
MAX_GBIT = 1e6
_REL_TOL = 1e-12


class PlanError(ValueError):
    """A plan that cannot describe a run; the message names the field and what it must be."""


@dataclass(frozen=True)
class Plan:
    """What a run looks like to the network: sizes, schedule, links. Defaults: docs/plan.md."""

    params: float = 1.0e9  # parameters exchanged (the whole model)
    step_s: float | None = 0.1  # pure compute per inner step; None: from tokens_per_step, site_tflops, mfu
    sync_every: int = 100  # H: inner steps per outer round
    bits: float = 32.0  # uplink bits per value (fp32 32, bf16 16, int8 8, FP4/e3m0 4)
    down_bits: float | None = None  # downlink bits per value; None: the same as bits
    fragments: int = 1  # F: streaming fragments, one synced every H/F steps
    overlap_steps: int = 0  # τ: inner steps a fragment's sync may run behind (blocking only)
    outer_mode: str = "blocking"  # blocking | eager | delayed
    sites: int = 4  # N: sites (mode=ddp: ranks of the all-reduce)
    bandwidth_gbit: float = 1.0  # each site's link, Gbit/s each way
    coordinator_bandwidth_gbit: float | None = None  # the coordinator's link; None: the same as a site's
    rtt_ms: float = 100.0  # round-trip time between a site and the coordinator (allreduce: neighbours)
    overhead_s: float = 0.0  # fixed seconds per sync besides the coordinator's CPU model: the sites' encode and decode
    # How much longer the slowest site takes over the steps between two syncs than the average
    # site, as a fraction (0.02: 2%): each sync waits that long for the slowest site's push.
    # 0: identical sites arriving together.
    straggle: float = 0.0
    # The same wait in seconds per sync, whatever the steps between syncs: the sites' arrival
    # jitter at each barrier (shared hardware, the OS's scheduling). Adds to ``straggle``.
    straggle_s: float = 0.0
    mode: str = "diloco"  # diloco | ddp (all-reduce of the gradients every step)
    topology: str = "coordinator"  # coordinator (this project) | allreduce (ring among the sites)
    layers: int | None = None  # allreduce/ddp: the sync follows the backward pass layer by layer
    backward_fraction: float = 2 / 3  # share of a step spent in the backward pass
    tokens_per_step: float | None = None  # step_s=None: tokens one site processes per inner step
    site_tflops: float | None = None  # step_s=None: one site's peak TFLOP/s (all its accelerators)
    mfu: float = 0.4  # step_s=None: model FLOPs utilization
    # The coordinator (topology=coordinator): S shards, each a process serving a balanced 1/S of
    # the parameters, placed on hosts of their own, on one host, or one beside each site.
    shards: int = 1
    shard_placement: str = "hosts"  # hosts | one_host | beside_sites (S = N)
    coordinator_cores: int | None = None  # one_host: the host's cores for its S processes; None: one a shard
    # Its CPU: one shard process on one core (diloco.plan.coordinator). Ingest, the decode and add
    # into the round's sum once gRPC has the bytes, in parameters per second: one number for the
    # run's codec, or {codec: rate}; None: MEASURED_INGEST_PARAMS_PER_S. inf: no cost.
    ingest_params_per_s: float | dict[str, float] | None = None
    grpc_bytes_per_cpu_s: float = MEASURED_GRPC_BYTES_PER_CPU_S  # bytes received or sent per CPU-second (inf: no cost)
    commit_s_per_param: float = MEASURED_COMMIT_S_PER_PARAM  # CPU-s per parameter of a shard's range per commit
    codec: str | None = None  # the uplink codec, which picks ingest_params_per_s's rate; None: the one bits names

    def __post_init__(self) -> None:
        if isinstance(self.ingest_params_per_s, Mapping):  # a copy of its own: a caller's later change does not reach it
            object.__setattr__(self, "ingest_params_per_s", dict(self.ingest_params_per_s))
        why = plan_problem(self)
        if why is not None:
            raise PlanError(why)

    @property
    def compute_step_s(self) -> float:
        """Seconds of pure compute per inner step: given, or 6·params·tokens / (mfu·peak)."""
        if self.step_s is not None:
            return float(self.step_s)
        assert self.tokens_per_step is not None and self.site_tflops is not None
        return 6.0 * self.params * self.tokens_per_step / (self.mfu * self.site_tflops * 1e12)

    @property
    def per_layer(self) -> bool:
        """Whether a sync's pieces leave as the backward pass frees each layer: only an all-reduce
        can start that early; this project's sites push Δ after the step, whole."""
        return self.layers is not None and (self.mode == "ddp" or self.topology == "allreduce")

    @property
    def ring(self) -> bool:
        """Whether the sites exchange by a ring all-reduce (ddp always does, as gloo here)."""
        return self.mode == "ddp" or self.topology == "allreduce"

    @property
    def steps_per_round(self) -> int:
        return 1 if self.mode == "ddp" else self.sync_every

    @property
    def syncs_per_round(self) -> int:
        return 1 if self.mode == "ddp" else self.fragments

    @property
    def window_steps(self) -> float:
        """Inner steps a sync may take before the site needs it back: τ while blocking (0: plain
        DiLoCo), the whole next inner phase for eager and delayed, none for ddp."""
        if self.mode == "ddp":
            return 0.0
        return float(self.sync_every) if self.outer_mode != "blocking" else float(self.overlap_steps)


@dataclass(frozen=True)
class Prediction:
    """One plan's steady state. A round is H inner steps (mode=ddp: one step) and holds F syncs;
    times in seconds, bytes per site."""

    utilization: float  # compute_s / round_s
    round_s: float  # wall time of a round: compute_s + stall_s
    compute_s: float  # H x step_s
    stall_s: float  # time per round the site waits for syncs
    sync_s: float  # one sync (one fragment) alone: latency + overhead + transfer + the coordinator's CPU
    hidden_s: float  # how long past its step's end a sync may run before the site waits (layer by layer: plus the backward pass)
    step_s: float
    steps_per_round: int
    syncs_per_round: int
    latency_s: float  # per sync: round trips (coordinator: 1 RTT; ring: (N-1) RTT)
    transfer_s: float  # per sync: bytes over the per-site rate
    payload_bytes_up: float  # per sync: what one site's encoded Δ (one fragment) weighs
    payload_bytes_down: float  # per sync: the update a site receives
    sent_bytes_per_round: float  # what one site sends per round (ring: its share of both phases)
    received_bytes_per_round: float  # what one site receives per round
    rate_gbit: float  # the per-site rate the transfers get
    mean_gbit: float  # the busier direction's bytes per round / round_s: a site link's average use
    bottleneck: str  # what sets rate_gbit
    # The coordinator (topology=coordinator; a ring has none: zeros). Per sync: the parts of
    # sync_s = latency_s + max(site_link_s, shard_link_s) + overhead + cpu_s (+ the straggle).
    cpu_s: float  # the shards' CPU (ingest, commit, send), in parallel: wall seconds
    site_link_s: float  # a site's link alone, at its full rate
    shard_link_s: float  # a coordinator host's link alone, carrying its shards' traffic with every site
    sync_bottleneck: str  # the largest of the three: site link | shard link | shard CPU
    shards: int  # S
    coordinator_hosts: int  # hosts: S; one_host: 1; beside_sites: the N sites' hosts
    shard_cpu_s_per_round: float  # one shard process's CPU-seconds per round: the three below
    shard_ingest_cpu_s_per_round: float  # N pushes of its range: gRPC receive + decode and sum
    shard_commit_cpu_s_per_round: float  # its range's commit: outer step, downlink encoding, hash, checkpoint
    shard_send_cpu_s_per_round: float  # N updates of its range through gRPC
    host_bytes_in_per_round: float  # one coordinator host's link (beside_sites: a site's, its own traffic included)
    host_bytes_out_per_round: float
    host_mean_gbit: float  # the busier direction / round_s: what that link must sustain for the round


# ---- validation --------------------------------------------------------------------------


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _positive(name: str, v: object, *, finite: bool = True) -> str | None:
    if not _is_number(v) or not v > 0 or (finite and math.isinf(v)):  # type: ignore[operator,arg-type]
        return f"{name}={v!r}: must be a number > 0"
    return None


def _non_negative(name: str, v: object) -> str | None:
    if not _is_number(v) or not 0 <= v < math.inf:  # type: ignore[operator]
        return f"{name}={v!r}: must be a finite number >= 0"
    return None


def _integer(name: str, v: object, low: int) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        return f"{name}={v!r}: must be an integer >= {low}"
    return None


def _choice(name: str, v: object, allowed: tuple[str, ...]) -> str | None:
    if v not in allowed:
        return f"{name}={v!r}: must be one of {', '.join(allowed)}"
    return None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def _field_problems(p: Plan) -> str | None:
    """Each field on its own."""
    return _first(
        _choice("mode", p.mode, MODES),
        _choice("topology", p.topology, TOPOLOGIES),
        _choice("outer_mode", p.outer_mode, OUTER_MODES),
        _positive("params", p.params),
        None if p.step_s is None else _positive("step_s", p.step_s),
        _integer("sync_every", p.sync_every, 1),
        _integer("fragments", p.fragments, 1),
        _integer("overlap_steps", p.overlap_steps, 0),
        _integer("sites", p.sites, 1),
        _positive("bits", p.bits),
        None if p.down_bits is None else _positive("down_bits", p.down_bits),
        _positive("bandwidth_gbit", p.bandwidth_gbit, finite=False),
        None if p.coordinator_bandwidth_gbit is None else _positive("coordinator_bandwidth_gbit", p.coordinator_bandwidth_gbit, finite=False),
        _non_negative("rtt_ms", p.rtt_ms),
        _non_negative("overhead_s", p.overhead_s),
        _non_negative("straggle", p.straggle),
        _non_negative("straggle_s", p.straggle_s),
        None if p.layers is None else _integer("layers", p.layers, 1),
        None if _is_number(p.backward_fraction) and 0 <= p.backward_fraction < 1 else f"backward_fraction={p.backward_fraction!r}: must be a number in [0, 1)",
        None if _is_number(p.mfu) and 0 < p.mfu <= 1 else f"mfu={p.mfu!r}: must be a number in (0, 1]",
        None if p.tokens_per_step is None else _positive("tokens_per_step", p.tokens_per_step),
        None if p.site_tflops is None else _positive("site_tflops", p.site_tflops),
        _integer("shards", p.shards, 1),
        _choice("shard_placement", p.shard_placement, PLACEMENTS),
        None if p.coordinator_cores is None else _integer("coordinator_cores", p.coordinator_cores, 1),
        None if p.codec is None else _choice("codec", p.codec, CODECS),
        _ingest_problem(p.ingest_params_per_s),
        _positive("grpc_bytes_per_cpu_s", p.grpc_bytes_per_cpu_s, finite=False),
        _non_negative("commit_s_per_param", p.commit_s_per_param),
    )


def _ingest_problem(v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        return _positive("ingest_params_per_s", v, finite=False)
    unknown = sorted(str(k) for k in v if k not in CODECS)
    if unknown:
        return f"ingest_params_per_s: unknown codec(s) {', '.join(unknown)} (known: {', '.join(CODECS)})"
    return _first(*(_positive(f"ingest_params_per_s.{k}", r, finite=False) for k, r in v.items()))


def _compute_problem(p: Plan) -> str | None:
    if p.step_s is None and (p.tokens_per_step is None or p.site_tflops is None):
        return "step_s=None: give step_s, or tokens_per_step and site_tflops (step_s = 6 x params x tokens_per_step / (mfu x site_tflops))"
    return None


def _schedule_problem(p: Plan) -> str | None:
    """The schedule, with diloco.site.overlap.SyncSchedule's rules and words, so that a plan
    the planner accepts is one this project can run (the paper's setting, topology=allreduce,
    may space its fragments unevenly: H need not be divisible by F there)."""
    if p.mode == "ddp":
        for name, value, default in (("fragments", p.fragments, 1), ("overlap_steps", p.overlap_steps, 0), ("outer_mode", p.outer_mode, "blocking")):
            if value != default:
                return f"{name}={value!r}: mode=ddp all-reduces the gradients every step; fragments, overlap_steps and outer_mode belong to mode=diloco"
        return None
    if p.topology == "coordinator" and p.sync_every % p.fragments:
        return f"sync_every={p.sync_every} is not divisible by fragments={p.fragments}: a fragment syncs every H/F steps"
    if p.overlap_steps >= p.sync_every / p.fragments:
        return f"overlap_steps={p.overlap_steps}: must be below sync_every/fragments = {p.sync_every / p.fragments:g} (one sync in flight at a time)"
    if p.outer_mode != "blocking" and (p.fragments > 1 or p.overlap_steps > 0):
        return (
            f"outer_mode={p.outer_mode} overlaps the whole sync with the next inner phase; it cannot be combined with "
            f"fragments={p.fragments} or overlap_steps={p.overlap_steps} (use outer_mode=blocking for streaming)"
        )
    if p.per_layer and p.layers is not None and p.layers < p.fragments:
        return f"layers={p.layers}: fewer layers than fragments={p.fragments}; a fragment holds whole layers"
    return None


def plan_problem(p: Plan) -> str | None:
    """What makes ``p`` unusable, naming the field; None when it is sound."""
    return _first(_field_problems(p), _compute_problem(p), _schedule_problem(p), coordinator_problem(p))


def plan_from_mapping(values: Mapping[str, Any]) -> Plan:
    """A Plan from plain data (a resolved hydra config, JSON); unknown keys fail, naming them."""
    known = {f.name for f in fields(Plan)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanError(f"unknown key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return Plan(**dict(values))


# ---- the time model ----------------------------------------------------------------------


def _down_bits(p: Plan) -> float:
    return float(p.bits if p.down_bits is None else p.down_bits)


@dataclass(frozen=True)
class _Link:
    """What one sync costs on a site's link and at the coordinator: seconds per parameter
    carried, and the fixed part."""

    s_per_param: float  # link seconds per parameter of the sync (both directions): the slower of the site's and the host's links
    push_s_per_param: float  # of those, the push leg's
    site_s_per_param: float  # the site's link alone
    host_s_per_param: float  # a coordinator host's link alone
    cpu_s_per_param: float  # the coordinator's CPU, wall seconds (ingest, commit, send)
    cpu_push_s_per_param: float  # of it, until the commit (ingest and commit)
    latency_s: float
    overhead_s: float
    straggle_s: float  # per sync, the wait for the slowest site's push: never hidden (see _stall)
    rate_gbit: float
    bottleneck: str
    sent_bits_per_param: float  # bits one site sends per parameter of the sync
    received_bits_per_param: float

    @property
    def fixed_s(self) -> float:
        return self.latency_s + self.overhead_s


def _per_param(bits: float, gbit: float) -> float:
    return 0.0 if math.isinf(gbit) else bits / (gbit * 1e9)


def _link(p: Plan) -> _Link:
    """Coordinator: every site pushes to and pulls from the coordinator's S shards, push then
    pull, 1 RTT (the pull goes out behind the push and is held until the commit: the push's last
    byte takes half an RTT to arrive, the update's first half an RTT back); a site's rate is its
    own link's or its share of a coordinator host's, whichever is less; the shards' CPU follows
    (diloco.plan.coordinator). Ring all-reduce: each site sends and receives (N-1)/N of the
    payload per direction (reduce-scatter at the uplink's bits, all-gather at the downlink's)
    over 2(N-1) hops of half an RTT each."""
    n, rtt, b = p.sites, p.rtt_ms / 1000.0, p.bandwidth_gbit
    up, down = float(p.bits), _down_bits(p)
    if p.ring:
        # Full duplex: a site receives as much as it sends, at the same time.
        sent = received = push = link_bits = site_bits = (n - 1) / n * (up + down)
        rate, latency, neck = b, (n - 1) * rtt, "a ring all-reduce over the site links"
        host_bits, host_gbit = 0.0, math.inf
    elif p.shard_placement == "beside_sites":
        # Full duplex too: the site's push to the other N-1 shards goes out while the other
        # sites' pushes to its shard come in; then the updates, the same way.
        sent = received = link_bits = site_bits = host_bits = (n - 1) / n * (up + down)
        push, rate, latency, host_gbit = (n - 1) / n * up, b, rtt, b
        neck = "the site's own link, which the shard beside it shares"
    else:
        # Push, then pull: the two legs follow each other. A host's link carries, per site,
        # its shards' share of the model: 1/S of it on a shard host of its own, all of it on one host.
        host_gbit = b if p.coordinator_bandwidth_gbit is None else p.coordinator_bandwidth_gbit
        sites_per_link = n / p.shards if p.shard_placement == "hosts" else float(n)
        sent, received = up, down
        link_bits, site_bits, host_bits = up + down, up + down, sites_per_link * (up + down)
        rate, latency = min(b, host_gbit / sites_per_link), rtt
        push = up
        if b <= host_gbit / sites_per_link:
            neck = "the site's own link"
        elif p.shards == 1:
            neck = f"the coordinator's link shared by {n} sites"
        elif p.shard_placement == "hosts":
            neck = f"each shard host's link, shared by {n} sites for 1/{p.shards} of the model"
        else:
            neck = f"the coordinator host's link shared by {n} sites ({p.shards} shards)"
    sh = shards(p)
    straggle_s = p.straggle * p.compute_step_s * p.steps_per_round / p.syncs_per_round + p.straggle_s
    return _Link(
        s_per_param=_per_param(link_bits, rate),
        push_s_per_param=_per_param(push, rate),
        site_s_per_param=_per_param(site_bits, b),
        host_s_per_param=_per_param(host_bits, host_gbit),
        cpu_s_per_param=sh.cpu * sh.wall_per_cpu_s,
        cpu_push_s_per_param=(sh.ingest_cpu + sh.commit_cpu) * sh.wall_per_cpu_s,
        latency_s=latency,
        overhead_s=float(p.overhead_s),
        straggle_s=straggle_s,
        rate_gbit=rate,
        bottleneck=neck,
        sent_bits_per_param=sent,
        received_bits_per_param=received,
    )


def _fragment_layers(p: Plan, fragment: int) -> range:
    """Strided fragments, as in Streaming DiLoCo and this project: layers f, f+F, f+2F, ..."""
    assert p.layers is not None
    return range(fragment, p.layers, p.syncs_per_round)


def _pieces(p: Plan, fragment: int) -> list[tuple[float, float, float]]:
    """(may start at, share of the parameters, needed back by) for each piece of one sync.
    Whole: at the step's end, needed after the window. Per layer (the paper's DAG): layer l's
    gradient is ready l backward-layers before the step ends (layer 0 last) and is needed when
    the forward pass reaches layer l in the step after the window."""
    step, window = p.compute_step_s, p.window_steps * p.compute_step_s
    if not p.per_layer:
        return [(0.0, 1.0 / p.syncs_per_round, window)]
    assert p.layers is not None
    bwd = p.backward_fraction * step / p.layers
    fwd = (1.0 - p.backward_fraction) * step / p.layers
    return [(-layer * bwd, 1.0 / p.layers, window + layer * fwd) for layer in _fragment_layers(p, fragment)]


def _stall(pieces: list[tuple[float, float, float]], params: float, link: _Link) -> float:
    """The site's wait for one sync: its pieces cross the link one at a time in the order they
    become ready, each then pays the fixed latency and overhead; the wait is the worst lateness.
    A coordinator's CPU adds to the link's time: the model counts no overlap between the two
    (docs/plan.md, "What it leaves out"). Plus the straggle: a site faster than the slowest
    gets ahead of it by that much per sync interval, and any slack (τ steps, a whole phase) is
    used up after a few intervals, so in the steady state every sync waits for it, whatever
    the overlap."""
    free, worst = -math.inf, -math.inf
    for ready, share, needed in sorted(pieces):
        free = max(ready, free) + share * params * (link.s_per_param + link.cpu_s_per_param)
        worst = max(worst, free + link.fixed_s - needed)
    return max(0.0, worst) + link.straggle_s


def predict(p: Plan) -> Prediction:
    """The steady-state round of plan ``p``: every one of its F syncs per round stalls the site
    by its own lateness, and the round is its compute plus those stalls."""
    link = _link(p)
    step = p.compute_step_s
    compute = p.steps_per_round * step
    stall = sum(_stall(_pieces(p, f), p.params, link) for f in range(p.syncs_per_round))
    round_s = compute + stall
    share = 1.0 / p.syncs_per_round
    transfer = share * p.params * link.s_per_param
    cpu = share * p.params * link.cpu_s_per_param
    sent_bytes = p.params * link.sent_bits_per_param / 8.0
    received_bytes = p.params * link.received_bits_per_param / 8.0
    sh = shards(p)
    host_in, host_out = p.params * sh.host_in_bits / 8.0, p.params * sh.host_out_bits / 8.0
    parts = {"site link": link.site_s_per_param, "shard link": link.host_s_per_param, "shard CPU": link.cpu_s_per_param}
    return Prediction(
        utilization=compute / round_s,
        round_s=round_s,
        compute_s=compute,
        stall_s=stall,
        sync_s=link.fixed_s + transfer + cpu,
        hidden_s=p.window_steps * step,
        step_s=step,
        steps_per_round=p.steps_per_round,
        syncs_per_round=p.syncs_per_round,
        latency_s=link.latency_s,
        transfer_s=transfer,
        payload_bytes_up=share * p.params * p.bits / 8.0,
        payload_bytes_down=share * p.params * _down_bits(p) / 8.0,
        sent_bytes_per_round=sent_bytes,
        received_bytes_per_round=received_bytes,
        rate_gbit=link.rate_gbit,
        mean_gbit=max(sent_bytes, received_bytes) * 8.0 / round_s / 1e9,
        bottleneck=link.bottleneck,
        cpu_s=cpu,
        site_link_s=share * p.params * link.site_s_per_param,
        shard_link_s=share * p.params * link.host_s_per_param,
        sync_bottleneck=max(parts, key=lambda k: parts[k]),  # a tie goes to the first
        shards=p.shards if not p.ring else 0,
        coordinator_hosts=sh.hosts,
        shard_cpu_s_per_round=p.params * sh.cpu,
        shard_ingest_cpu_s_per_round=p.params * sh.ingest_cpu,
        shard_commit_cpu_s_per_round=p.params * sh.commit_cpu,
        shard_send_cpu_s_per_round=p.params * sh.send_cpu,
        host_bytes_in_per_round=host_in,
        host_bytes_out_per_round=host_out,
        host_mean_gbit=max(host_in, host_out) * 8.0 / round_s / 1e9,
    )


def run_utilization(p: Plan, rounds: int, *, tail: bool = True, flush: bool = True) -> float:
    """Utilization over a whole run of ``rounds`` rounds rather than the steady state: the run
    ends once its last sync has landed, and nothing overlaps that one (no inner phase follows
    it), so an overlapped mode pays it whole once (a blocking sync pays it every round anyway).
    With fragments, the F − 1 flush rounds after the last (docs/streaming.md) follow it
    pipelined: each is pushed once the round before it is committed, while that round's update
    comes down, so each adds its push leg (``_push_leg``) and the last pull ends the run.
    ``flush=False``: a run whose fragments freeze at their last push (``fragment_end=freeze``)
    has no flush rounds, only the last sync.
    ``tail=False``: up to the end of the run's last inner step (the last round's stall, and the
    syncs after it, left out): what ``utilization_until_last_step`` measures."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise PlanError(f"rounds={rounds!r}: must be an integer >= 1")
    pred = predict(p)
    last_steady = pred.stall_s / pred.syncs_per_round  # what the last sync would stall in the steady state
    last_whole = (
        _stall(_pieces(replace(p, overlap_steps=0, outer_mode="blocking"), pred.syncs_per_round - 1), p.params, _link(p)) if p.mode != "ddp" else last_steady
    )
    if not tail:
        return rounds * pred.compute_s / (rounds * pred.round_s - last_steady)
    flushes = (p.fragments - 1) * _push_leg(p) if p.mode != "ddp" and flush else 0.0
    total = rounds * pred.round_s + max(0.0, last_whole - last_steady) + flushes
    return rounds * pred.compute_s / total


def _push_leg(p: Plan) -> float:
    """One fragment's push until its round is committed: its bytes up, the coordinator's ingest
    and commit, its last byte's way there and the commit's notice back (one RTT), the sync's
    fixed cost, and the wait for the slowest site."""
    link = _link(p)
    up = p.params / p.syncs_per_round * (link.push_s_per_param + link.cpu_push_s_per_param)
    return up + link.latency_s + link.overhead_s + link.straggle_s


# ---- the inverse -------------------------------------------------------------------------


def _check_target(target: float) -> None:
    if not _is_number(target) or not 0 < target < 1:
        raise PlanError(f"target={target!r}: must be a utilization in (0, 1)")


def _utilization_at(p: Plan, gbit: float) -> float:
    """Utilization with every site's link at ``gbit`` (and the coordinator's too when the plan
    leaves it unset, so that it follows the sites' links)."""
    return predict(replace(p, bandwidth_gbit=gbit)).utilization


def bandwidth_needed(p: Plan, target: float) -> float | None:
    """The smallest site bandwidth (Gbit/s) at which ``p`` reaches utilization ``target``,
    everything else fixed; None when no bandwidth does (latency, overhead, the coordinator's CPU
    or a fixed coordinator link alone keep it below), 0.0 when it needs none. Utilization only
    grows with bandwidth, so bracketing by doubling and then bisecting on a log scale finds it
    to 1e-12 relative."""
    _check_target(target)

    def meets(gbit: float) -> bool:
        return _utilization_at(p, gbit) >= target

    if not meets(math.inf):
        return None
    lo = hi = 1.0
    if meets(hi):
        while meets(lo):
            lo /= 2
            if lo < MIN_GBIT:
                return 0.0
        hi = lo * 2
    else:
        while not meets(hi):
            hi *= 2
            if hi > MAX_GBIT:
                return None
        lo = hi / 2
    while hi / lo - 1 > _REL_TOL:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi


def _target_key(target: float) -> str:
    return f"{target * 100:g}"


def bandwidth_table(p: Plan, targets: tuple[float, ...] = TARGETS) -> dict[str, float | None]:
    """{"50": Gbit/s, "80": ..., ...}: bandwidth_needed for each target, keyed by percent."""
    return {_target_key(t): bandwidth_needed(p, t) for t in targets}


def paper_grid_step(gbit: float | None, rule: str = "down") -> float | None:
    """The point of the paper's bandwidth grid a continuous threshold lands on: ``down``, the
    largest grid point at or below it (the rule that reproduces most of Table 4, docs/plan.md),
    or ``up``, the smallest at or above it. None off the grid or for None."""
    if gbit is None:
        return None
    tol = 1 + 1e-9
    if rule == "down":
        below = [g for g in PAPER_GRID_GBIT if g <= gbit * tol]
        return below[-1] if below else None
    if rule == "up":
        return next((g for g in PAPER_GRID_GBIT if g * tol >= gbit), None)
    raise PlanError(f"rule={rule!r}: must be down or up")


# ---- a report --------------------------------------------------------------------------------


def _finite_or_none(v: Any) -> Any:
    """JSON has no Infinity: an infinite bandwidth (a what-if) is reported as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def plan_report(p: Plan, targets: tuple[float, ...] = TARGETS) -> dict[str, Any]:
    """The prediction, the bandwidth each target needs and the plan itself, as plain data:
    what ``diloco-plan --json`` prints and what a caller can store next to a run."""
    out: dict[str, Any] = {k: _finite_or_none(v) for k, v in vars(predict(p)).items()}
    out["bandwidth_needed_gbit"] = bandwidth_table(p, targets)
    out["plan"] = {f.name: _finite_or_none(getattr(p, f.name)) for f in fields(Plan)}
    if isinstance(p.ingest_params_per_s, Mapping):
        out["plan"]["ingest_params_per_s"] = {k: _finite_or_none(v) for k, v in p.ingest_params_per_s.items()}
    return out
