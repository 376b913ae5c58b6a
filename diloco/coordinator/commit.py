"""Closing a round: the guard's verdict, the outer step with the downlink's encoding, and the
round's record. Functions of their arguments (the outer optimizer and the downlink's error
feedback are the state they move), called by the coordinator under its lock."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.codec import Codec, is_lossless
from diloco.coordinator import commit_blocks, kernels
from diloco.coordinator.guard import SpikeGuard
from diloco.coordinator.round_state import RoundState
from diloco.coordinator.shard_step import ShardStep
from diloco.outer import ErrorFeedback, OuterOptimizer, OuterStepRefused, StackedAggregate, WeightedMean, check_update
from diloco.outer.pseudo_gradient import combine_sha256
from diloco.types import Chunk, PushHeader, TensorSpec
from diloco.wire import ChunkAssembler, encode_chunks
from diloco.wire.chunks import zero_chunks


@dataclass
class RoundRecord:
    """What happened in one committed round; handed to ``on_commit`` listeners."""

    round: int
    participants: list[str]
    tokens: int
    inner_steps: int
    bytes_up: int
    train_loss: float | None
    update_norm: float
    global_sha256: str
    wall_s: float  # from the round's opening (previous commit or start) to its commit
    elapsed_s: float  # from coordinator start to this commit
    params: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    delta_norm: float = 0.0  # of the participants' weighted mean Δ (what the guard judges)
    rejected: bool = False  # the round was rejected (the guard, or a mean Δ / outer step that is not finite or absurd): θ did not move
    guard: str | None = None  # why it was rejected, with the figures
    absent: list[str] = field(default_factory=list)  # active sites that did not push this round
    merged: list[dict[str, Any]] = field(default_factory=list)  # late pushes merged in: site, round, weight factor, tokens
    evicted: list[str] = field(default_factory=list)  # sites whose lease ended while the round was open
    refused: list[dict[str, Any]] = field(default_factory=list)  # pushes judged and not counted (robust.*): site, round, norm, reference, why
    clipped: list[dict[str, Any]] = field(default_factory=list)  # pushes counted scaled down (robust.action=clip): ..., scale
    withheld: list[dict[str, Any]] = field(default_factory=list)  # sites that had no Δ for the round: site, round, why
    # sharded sites' pushes: site -> per part {part, whole: tensors sent whole, sliced: tensors sent as slices, numel}
    sliced: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    fragment: int = 0  # the fragment of the parameters this round synced (fragments=F: round mod F)

    def summary(self) -> dict[str, Any]:
        """Everything but the θ snapshot (kept in checkpoints, to rewrite lost metrics lines)."""
        return {k: v for k, v in self.__dict__.items() if k != "params"}


@dataclass(frozen=True)
class UpdateEncoder:
    """How an update goes down: its codec, its chunk size, and (lossy codecs) its error feedback."""

    codec: Codec
    specs: Mapping[str, TensorSpec]
    chunk_bytes: int
    feedback: ErrorFeedback | None

    @staticmethod
    def of(codec: Codec, specs: Mapping[str, TensorSpec], chunk_bytes: int, error_feedback: bool) -> UpdateEncoder:
        return UpdateEncoder(codec, specs, chunk_bytes, ErrorFeedback() if error_feedback and not is_lossless(codec.name) else None)

    def encode(self, update: Mapping[str, torch.Tensor], views: bool = False) -> list[Chunk]:
        """``views``: payloads may be views of ``update``'s memory (the Downlink copies them
        into bytes, bundled, off the commit's path: diloco.coordinator.downlink)."""
        return list(encode_chunks(update, codec=self.codec, chunk_bytes=self.chunk_bytes, views=views))

    def encode_zeros(self, names: Iterable[str]) -> list[Chunk]:
        """``encode`` of a zero update of ``names`` (the sites' update of a refused round), from
        one block of zeros: the same chunks, without a zero tensor of the model's size."""
        return list(zero_chunks({n: self.specs[n] for n in names}, codec=self.codec, chunk_bytes=self.chunk_bytes))

    def transmit(self, proposed: dict[str, torch.Tensor], sink: Callable[[list[Chunk]], None]) -> dict[str, torch.Tensor]:
        """Encodes the update once (handed to ``sink``) and returns it decoded, exactly as every
        site will decode it. The encoding error goes into the next round's update (server-side
        error feedback), so a lossy downlink loses nothing over time. A lossless codec
        delivers exactly what it encodes: ``proposed`` itself is returned, not decoded again."""
        if is_lossless(self.codec.name):
            sink(self.encode(proposed, views=True))  # nothing writes to the update after this
            return proposed
        if self.feedback is not None:
            proposed = self.feedback.compensate(proposed)
        chunks = self.encode(proposed)
        assembler = ChunkAssembler({n: self.specs[n] for n in proposed})  # all tensors, or one fragment's
        for c in chunks:
            assembler.add(c)
        sent = assembler.finish()
        check_update("update as sent", sent)
        if self.feedback is not None:
            self.feedback.carry(ErrorFeedback.error(proposed, sent))
        sink(chunks)
        return sent


Each = Callable[[Callable[[ShardStep], Any], list[ShardStep]], list[Any]]


@dataclass(frozen=True)
class Closing:
    """Who is in a closing round, and the times its record needs."""

    active: frozenset[str]
    now: float
    started: float  # the coordinator's start (elapsed_s counts from it)
    snapshot: bool  # attach a copy of θ to the record


def commit(
    state: RoundState,
    acc: WeightedMean | StackedAggregate,
    outer: OuterOptimizer,
    guard: SpikeGuard,
    encoder: UpdateEncoder,
    closing: Closing,
    times: dict[str, float] | None = None,
) -> tuple[RoundRecord, list[Chunk]]:
    """Applies the round (``state``: who it counts; ``acc``: the sum of what they pushed):
    the guard judges the participants' mean Δ; if accepted, the outer
    optimizer steps (its update encoded once for the sites), else θ stays and the sites get a
    zero update. Total: whatever the pushes held, it returns the round's record and its
    encoded update; a mean Δ or an outer step that is not finite, or absurd, rejects the
    round (θ, the optimizer state and the downlink residual stay as they were). ``times``
    (optional) gets the seconds of its parts: mean_s, step_s (the outer step, the downlink's
    encoding included: encode_s), record_s (the round's record, θ's hash included; on the
    blockwise path the hash is taken during the step, and mean_s is its first pass).

    Norms are ``outer.norm``'s. On the blockwise path the step is all or nothing against
    anything the pushes held (every check runs before the first write); an error of the
    machine itself midway through its writes (out of memory) propagates, and the coordinator
    fails and restarts from its last checkpoint. One shard's case of ``commit_shards``."""
    return commit_shards(state, [ShardStep(state.names, acc, outer, encoder, state.number)], guard, closing, times)


def commit_shards(
    state: RoundState,
    shards: list[ShardStep],
    guard: SpikeGuard,
    closing: Closing,
    times: dict[str, float] | None = None,
    each: Each = lambda fn, items: [fn(x) for x in items],
) -> tuple[RoundRecord, list[Chunk]]:
    """``commit`` of a round whose parameters are cut into ranges, each ``shards``' own (in
    name order: the update's chunks are theirs one after the other). The checks are made
    once, on whole-model figures added from each shard's per-tensor parts in name order, so
    θ, its hash and the record are those of one shard holding every parameter, bit for bit;
    a shard writes only once every check passed, and every shard or none steps.

    Norms are diloco.coordinator.kernels.squares' parts added in name order (kernels.norm's
    value where the compiled loops are present). ``each(fn, shards)``: runs a step on every
    shard, one after the other or at once (diloco.coordinator.shards: a thread each), and
    returns the results in order."""
    times = times if times is not None else {}
    t0 = time.perf_counter()
    r = state.number
    live = [s for s in shards if s.names]
    refusal = _uncounted(state)
    blockwise = refusal is None and all(s.blocks is not None for s in live)
    g_sq: dict[str, float] = {}
    if refusal is None:
        for got in each(lambda s: s.check_blocks() if blockwise else s.mean(), live):
            if isinstance(got, str):
                refusal = got
                break
            g_sq.update(got)
    delta_norm = _root([g_sq]) if refusal is None else math.nan
    if refusal is None and not math.isfinite(delta_norm):  # its norm is finite exactly when every value is
        refusal = "the mean Δ is not finite (a push's values times its tokens overflowed float32)"
    if refusal is None:
        verdict = guard.judge(delta_norm)
        refusal = None if verdict.accepted else verdict.describe()
    t1 = time.perf_counter()
    times["mean_s"] = t1 - t0
    theta_norm = functools.cache(lambda: _root(each(ShardStep.theta_sq, live)))
    stepped, update_norm = False, 0.0
    if refusal is None and blockwise:
        blocks = [s.blocks for s in live if s.blocks is not None]
        proposed_norm = _root(b.u_sq for b in blocks)
        try:
            check_update("proposed update", {}, size=proposed_norm, params_norm=theta_norm)
        except OuterStepRefused as e:
            refusal = str(e)
        else:
            first = blocks[0]
            bound_sq = commit_blocks.total(v for _, v in sorted(_union(b.bound_sq for b in blocks).items()))  # added as squares, no root
            if commit_blocks.sure_of(first.lossless, first.codec_block, all(b.x_finite for b in blocks), bound_sq, theta_norm):
                each(lambda s: s.apply_blocks(times), live)
                stepped = True
                update_norm = _root(s.sent_sq for s in live)
    if refusal is None and not stepped:  # the generic step (where the blockwise one cannot be sure of its checks, too)
        proposals = each(ShardStep.propose, live)
        times["encode_s"] = sum(p.encode_s for p in proposals)
        try:
            size = check_update("proposed update", {}, size=_root(p.u_sq for p in proposals), params_norm=theta_norm)
            failed = next((p.failed for p in proposals if p.failed is not None), None)
            if failed is not None:
                raise OuterStepRefused(failed)
            if any(p.sent_sq is not None for p in proposals):
                sent_sq = _union(p.sent_sq if p.sent_sq is not None else p.u_sq for p in proposals)
                size = check_update("update as sent", {}, size=_root([sent_sq]), params_norm=theta_norm)
        except OuterStepRefused as e:
            refusal = str(e)
            each(lambda s: s.settle(False, 0.0), live)
        else:
            each(lambda s: s.settle(True, size), live)
            stepped, update_norm = True, size
    if not stepped:
        for s in shards:  # θ, the outer optimizer and the downlink residual stay; sites apply a zero update
            s.zeros()
    t2 = time.perf_counter()
    times["step_s"] = t2 - t1
    pushed = sorted(state.pushes)
    headers = [state.pushes[s] for s in pushed]
    record = RoundRecord(
        round=r,
        participants=pushed,
        tokens=sum(h.tokens for h in headers if state.counted(h.site_id)),
        inner_steps=sum(h.inner_steps for h in headers),
        bytes_up=state.bytes_up,
        train_loss=weighted_loss(headers),
        update_norm=update_norm,
        delta_norm=delta_norm,
        rejected=refusal is not None,
        guard=refusal,
        absent=sorted(closing.active - set(pushed)),
        merged=list(state.merged),
        refused=list(state.refused),
        clipped=list(state.clipped),
        withheld=list(state.withheld),
        sliced={site: parts for site, parts in sorted(state.sliced.items()) if site in state.pushes},
        evicted=sorted(set(state.evicted)),
        fragment=state.fragment,
        global_sha256=combine_sha256(_union(each(ShardStep.theta_digests, shards))),
        wall_s=closing.now - state.opened_at,
        elapsed_s=closing.now - closing.started,
        params={n: p.clone() for s in shards for n, p in s.outer.params.items()} if closing.snapshot else None,
    )
    times["record_s"] = time.perf_counter() - t2
    return record, [c for s in shards for c in s.chunks]


def _root(parts: Iterable[Mapping[str, float]]) -> float:
    """The norm whose per-tensor squares the shards gave (``parts``), added in name order."""
    return kernels.root(v for _, v in sorted(_union(parts).items()))


def _union(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        out.update(p)
    return out


def _uncounted(state: RoundState) -> str | None:
    """Why the round has no mean Δ although sites pushed: none of their pushes counted."""
    if state.pushes and not any(state.counted(s) for s in state.pushes):
        return "no pseudo-gradient counted in this round (every push was withheld or refused): θ stays"
    return None


def describe_part(part: int, chunks: list[Chunk], specs: Mapping[str, TensorSpec]) -> dict[str, int]:
    """One part of a sharded push: how many tensors it sent whole, how many as slices, and
    how many elements in all."""
    whole = {c.name for c in chunks if c.box.is_whole(specs[c.name].shape)}
    sliced = {c.name for c in chunks} - whole
    return {"part": part, "whole": len(whole), "sliced": len(sliced), "numel": sum(c.numel for c in chunks)}


def weighted_loss(headers: list[PushHeader]) -> float | None:
    """Token-weighted mean of the reported inner losses; sites that report none (NaN) are skipped."""
    finite = [h for h in headers if math.isfinite(h.train_loss)]
    if not finite:
        return None
    return sum(h.train_loss * h.tokens for h in finite) / sum(h.tokens for h in finite)
