"""Every file of a run directory, as typed records: written and read here, and documented
from here (docs/outputs.md is generated from this module by scripts/gen_outputs_doc.py, and a
test fails when it is stale).

A field's ``doc`` says what it holds; an ``optional`` field is left out of the file when it
is None (it appears only in the runs it applies to).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from diloco.io import append_jsonl, read_jsonl, write_json_atomic
from diloco.run_dir import ENTRIES, GLOBAL, METRICS, PROGRESS, SUMMARY, WORKERS

R = TypeVar("R")


def _f(doc: str, *, optional: bool = False, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    meta = {"doc": doc, "optional": optional}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    if optional and default is dataclasses.MISSING:
        default = None
    return field(default=default, metadata=meta)


def to_dict(record: Any) -> dict[str, Any]:
    """The record as the file holds it: every field, optional ones only when set."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if not (f.metadata.get("optional") and getattr(record, f.name) is None)}


def from_dict(cls: type[R], d: dict[str, Any]) -> R:
    """A record from what a file holds; keys the record does not know are an error."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    return cls(**d)


def write(path: Path, record: Any) -> None:
    write_json_atomic(path, to_dict(record))


def read(path: Path, cls: type[R]) -> R:
    return from_dict(cls, json.loads(path.read_text()))


@dataclass
class MetricsLine:
    """One committed round (DiLoCo), or one block of ``sync_every`` steps (ddp, single)."""

    round: int = _f("round number, 0-based; each committed round appears exactly once")
    participants: list[str] = _f("sites whose push counted in this round (ddp/single: the ranks)")
    absent: list[str] = _f("active sites that did not push in time")
    evicted: list[str] = _f("sites whose lease ran out while the round was open")
    late: list[dict[str, Any]] = _f("pushes refused while this round was open, for rounds committed without them: {site, round}")
    merged: list[dict[str, Any]] = _f("late pushes merged into this round (quorum.late=merge): {site, round, weight, tokens}")
    rejected: bool = _f("the round was rejected (the loss-spike guard, or a mean Δ or outer step that is not finite or absurd): θ did not move")
    guard: str | None = _f("why the round was rejected, with the figures")
    tokens: int = _f("tokens of the participants' inner phases")
    inner_steps: int = _f("inner steps of the participants, summed")
    bytes_up: int = _f("payload bytes pushed into this round (pseudo-gradients)")
    bytes_down: int | None = _f("payload bytes pulled of this round's update (null in a line rewritten after a restart)")
    train_loss: float | None = _f("token-weighted mean inner training loss, nats per token")
    eval_loss: float | None = _f("held-out loss of θ after the round, nats per token (every eval_every rounds and the last)")
    eval_bpb: float | None = _f("eval_loss in bits per byte (bytes data only, else null)")
    eval_by: str | None = _f("who evaluated: coordinator | sites")
    update_norm: float | None = _f("L2 norm of the outer update applied to θ (null in the baselines)")
    delta_norm: float | None = _f("L2 norm of the participants' weighted mean Δ, which the guard judges (null in the baselines)")
    global_sha256: str = _f("θ's hash after the round (params_sha256: SHA-256 over each tensor's header and SHA-256): every site ends with the same")
    wall_s: float = _f("seconds from the round's opening to its commit")
    elapsed_s: float = _f("seconds from the coordinator's start to the commit")
    sliced: dict[str, list[dict[str, int]]] | None = _f("sharded sites: per part {part, whole, sliced, numel}", optional=True)
    eval_sites: list[str] | None = _f("evaluation by sites: the sites whose loss was averaged", optional=True)
    eval_tokens: int | None = _f("evaluation by sites: held-out tokens behind eval_loss", optional=True)
    recovered: bool | None = _f("true: written by a restarted coordinator for a round its predecessor committed", optional=True)
    refused: list[dict[str, Any]] | None = _f("pushes the norm bound refused (robust.norm_ratio): {site, round, norm, reference, why}", optional=True)
    clipped: list[dict[str, Any]] | None = _f("pushes counted scaled down (robust.action=clip): {site, round, norm, reference, scale, why}", optional=True)
    withheld: list[dict[str, Any]] | None = _f(
        "sites that had no pseudo-gradient for the round and said so (not counted; e.g. faults drop_push lost): {site, round, why}", optional=True
    )
    fragment: int | None = _f("fragments=F: the fragment of the parameters this round synced (round mod F)", optional=True)


def append_metrics(path: Path, line: MetricsLine) -> None:
    append_jsonl(path, to_dict(line))


def read_metrics(path: Path) -> list[MetricsLine]:
    return [from_dict(MetricsLine, d) for d in read_jsonl(path)]


def metrics_rounds(path: Path) -> set[int]:
    """The rounds a metrics.jsonl holds lines of (read leniently: the file a killed
    coordinator left is being repaired)."""
    return {int(d["round"]) for d in read_jsonl(path) if "round" in d}


@dataclass
class GlobalRecord:
    """The coordinator's report (ddp/single: rank 0's), written when it stops."""

    params: int = _f("number of parameters in θ")
    rounds_committed: int = _f("rounds committed")
    global_sha256: str = _f("sha256 of the final θ")
    final_eval_loss: float | None = _f("held-out loss of the final θ, nats per token")
    final_eval_bpb: float | None = _f("final_eval_loss in bits per byte (bytes data only)")
    wall_s: float = _f("seconds the process served (trained)")
    peak_rss_mb: float = _f("peak resident memory of the process, MiB")
    init_from: str | None = _f("where θ₀ came from (model config, file, or a site); null in the baselines", default=None)
    eval_by: str | None = _f("who evaluated θ: coordinator | sites; null in the baselines", default=None)
    site_reported_sha256: dict[str, str] | None = _f("site -> the θ hash it reported when it left", optional=True)
    port: int | None = _f("the port the coordinator listened on", optional=True)
    min_sites: int | None = _f("the quorum in force: a round never closed with fewer pushes", optional=True)
    security: str | None = _f("what the gRPC server served: TLS with client certificates and/or tokens, or plaintext", optional=True)
    resumed_from: dict[str, Any] | None = _f(
        "the checkpoint it resumed from: {round (committed rounds), global_sha256 (θ's, checked on restore)}", optional=True
    )
    refused_pushes: dict[str, int] | None = _f("site -> its pushes the norm bound refused over the run (robust.norm_ratio)", optional=True)
    commit_s_median: dict[str, float] | None = _f(
        "seconds of each part of a commit, the median over the run's (Coordinator.commit_timings): receive_s (the closing push's receive and decode), "
        "lock_s, commit_s (mean_s, step_s with encode_s, record_s), serve_s (the update bundled for the pulls), checkpoint_s (made durable), publish_s",
        optional=True,
    )
    fragments: list[dict[str, Any]] | None = _f("sync.fragments=F: the split (sync.split), per fragment {fragment, numel, names}", optional=True)


@dataclass
class WorkerRecord:
    """One site (DiLoCo) or rank (ddp, single), written when it finishes: workers/<id>.json."""

    site_id: str = _f("the site's id (baselines: the rank)")
    shard: int = _f("its data shard")
    rounds: int = _f("rounds it took part in (the hashes it recorded; baselines: every round)")
    tokens: int = _f("tokens of its rounds")
    inner_steps: int = _f("inner steps in its schedule at the end")
    bytes_up: int = _f("payload bytes it pushed (all ranks)")
    bytes_down: int = _f("payload bytes it pulled (all ranks)")
    global_sha256: str = _f("sha256 of its final θ (equal to global.json's in a healthy run)")
    wall_s: float = _f("seconds the process ran")
    peak_rss_mb: float = _f("peak resident memory of the process (leader rank), MiB")
    layout: str | None = _f("its layout: a name (single, ddp2, fsdp2, tp2, pp2, tp2_fsdp2), or its degrees above 1 (pp2_dp_shard2_tp2)", optional=True)
    device: str | None = _f("where it trained (cpu, cuda:0, …)", optional=True)
    ranks: int | None = _f("processes of the site", optional=True)
    bytes_up_per_rank: list[int] | None = _f("bytes_up per rank", optional=True)
    bytes_down_per_rank: list[int] | None = _f("bytes_down per rank", optional=True)
    sync_s_median_per_rank: list[dict[str, float]] | None = _f(
        "per rank, the median seconds of each part of an outer sync (delta, encode, push, wait, pull, apply)", optional=True
    )
    inner_step_s_median: float | None = _f("median seconds of an inner step", optional=True)
    steps_per_round: dict[str, int] | None = _f("round -> inner steps it ran (fewer than H under sync.budget_s)", optional=True)
    round_sha256: dict[str, str] | None = _f("round -> sha256 of its θ after the round", optional=True)
    dropped_rounds: list[int] | None = _f("rounds committed without its push (it came too late)", optional=True)
    merged_rounds: list[int] | None = _f("rounds whose late push was merged into a later round", optional=True)
    diverged_rounds: list[int] | None = _f(
        "rounds whose pseudo-gradient was not finite: withheld, the site restarted from θ with a fresh inner optimizer state", optional=True
    )
    uncounted: dict[str, str] | None = _f(
        "round -> why the coordinator took its push without counting it, or counted it scaled down (robust.*, a withheld push)", optional=True
    )
    momentum_pulled: list[int] | None = _f(
        "sync.mode=eager or sync.merge=ahead: the rounds whose outer momentum it took with a pull of θ (joining, or again after a restart)", optional=True
    )
    restored: dict[str, Any] | None = _f(
        "its own checkpoint restored at start: {round, exact (sampler and residual too), hash_matches (θ as the checkpoint recorded), tokens}", optional=True
    )
    rejoins: int | None = _f("times it had to join again (evicted, or forgotten by a restarted coordinator)", optional=True)
    reconnects: int | None = _f("calls retried because the coordinator could not be reached", optional=True)
    incarnation: int | None = _f("how many times this site's process was started again", optional=True)
    compute_utilization: float | None = _f("seconds in inner steps / seconds from joining to the last round landed", optional=True)
    utilization_until_last_step: float | None = _f("compute_utilization up to the end of the last inner step (without the run's final syncs)", optional=True)
    stall_s: float | None = _f(
        "seconds the inner loop waited on outer syncs (a blocking sync whole; with overlap, a merge due before its round had landed)", optional=True
    )
    stalls: int | None = _f("overlapped syncs that had not landed when their merge was due", optional=True)
    fragment_bytes: dict[str, dict[str, int]] | None = _f("fragments=F: fragment -> {up, down} payload bytes of this site (leader rank)", optional=True)
    sync_mode: str | None = _f("blocking | streaming (sync.fragments > 1 or sync.overlap > 0) | eager | delayed", optional=True)


@dataclass
class ProgressRecord:
    """progress/<site>.<incarnation>.json: what one site process trained so far and where it is, rewritten every step."""

    tokens: int = _f("tokens trained by this process, counted as it goes (goodput's denominator)")
    round: int | None = _f("the round its current inner phase trains for (diloco-sim's progress bar)", optional=True)
    step: int | None = _f("inner steps of that phase done so far", optional=True)
    steps: int | None = _f("inner steps the phase has (H, or H/fragments; 0 in a flush round)", optional=True)


@dataclass
class Summary:
    """diloco-sim's summary of the whole run: summary.json."""

    mode: str = _f("diloco | ddp | single")
    sites: int = _f("sites (ddp: ranks; single: 1)")
    sync_every: int = _f("H")
    rounds: int = _f("rounds configured")
    rounds_committed: int = _f("rounds committed")
    rounds_rejected: int = _f("rounds rejected (the guard, or a non-finite or absurd step)")
    refused_pushes: dict[str, int] = _f("site -> its pushes the norm bound refused (robust.norm_ratio); a site named here more than once is suspect")
    faults_injected: list[dict[str, Any]] = _f("the fault events that fired (faults.jsonl)")
    goodput: float | None = _f("tokens in committed rounds / every token any site process trained")
    model: str = _f("model name")
    codec: str = _f("uplink codec, with its parameters")
    codec_down: str = _f("downlink codec, with its parameters")
    seed: int = _f("the run's seed")
    params: int = _f("number of parameters")
    tokens: int = _f("tokens in committed rounds")
    final_eval_bpb: float | None = _f("held-out bits per byte of the final θ (bytes data)")
    final_eval_loss: float | None = _f("held-out loss of the final θ, nats per token")
    eval_by: str | None = _f("who evaluated θ")
    final_train_loss: float | None = _f("train_loss of the last round")
    bytes_up: int = _f("payload bytes pushed, all rounds")
    bytes_down: int = _f("payload bytes pulled, all rounds")
    wall_s: float = _f("seconds the simulation took")
    global_sha256: str = _f("sha256 of the final θ")
    site_global_sha256: dict[str, str] = _f("site -> the sha256 of its final θ")
    hashes_equal: bool = _f("every site ended with the coordinator's θ, bit for bit")
    peak_rss_mb: dict[str, float | None] = _f("process -> peak resident memory, MiB")
    run_dir: str = _f("where the run's files are")
    compute_utilization: dict[str, float] | None = _f("site -> its compute_utilization, and 'run': their mean", optional=True)
    utilization_until_last_step: dict[str, float] | None = _f("site -> its utilization_until_last_step, and 'run': their mean", optional=True)
    stall_s: dict[str, float] | None = _f("site -> seconds its inner loop waited on outer syncs", optional=True)
    fragment_bytes: dict[str, dict[str, int]] | None = _f("fragments=F: fragment -> {up, down} payload bytes, all sites", optional=True)
    wan: dict[str, Any] | None = _f(
        "diloco-sim's emulated links: per site and the coordinator's {up_mbit, down_mbit, rtt_ms, jitter_ms, window_kb}", optional=True
    )


@dataclass(frozen=True)
class RunFile:
    path: str
    what: str
    record: type | None = None
    written_by: str = ""


# The typed files of a run directory (the others are named, with what they hold, by diloco.run_dir.ENTRIES).
TYPED: dict[str, type] = {
    METRICS: MetricsLine,
    GLOBAL: GlobalRecord,
    WORKERS: WorkerRecord,
    PROGRESS: ProgressRecord,
    SUMMARY: Summary,
}
RUN_FILES: tuple[RunFile, ...] = tuple(RunFile(path, what, TYPED.get(path), who) for path, (what, who) in ENTRIES.items())


def outputs_markdown() -> str:
    """docs/outputs.md: every file of a run directory, and every field of the typed ones."""
    out = [
        "# What a run writes",
        "",
        "Generated from `diloco/app/records.py` by `scripts/gen_outputs_doc.py`; `tests/unit/test_records.py`",
        "fails when this file is stale. Fields marked *optional* appear only in the runs they apply to.",
        "",
        "| file | what | written by |",
        "|---|---|---|",
    ]
    out += [f"| `{f.path}` | {f.what} | {f.written_by} |" for f in RUN_FILES]
    for f in RUN_FILES:
        if f.record is None:
            continue
        out += ["", f"## `{f.path}`", "", (f.record.__doc__ or "").strip(), "", "| field | type | meaning |", "|---|---|---|"]
        for fld in dataclasses.fields(f.record):
            kind = str(fld.type).replace("|", "\\|")
            opt = " *(optional)*" if fld.metadata.get("optional") else ""
            out.append(f"| `{fld.name}` | `{kind}` | {fld.metadata['doc']}{opt} |")
    return "\n".join(out) + "\n"
