"""A site's half of the outer loop: join, push Δ, wait for the round, pull and apply u.

The pieces: the protocol steps and their retries (exchange.py), the uplink error feedback
(diloco.outer.ErrorFeedback), where a phase starts (phase_start.py), how a landed round meets
the local values (merge.py), the model as the sync sees it (local_model.py), the counters
(stats.py) and the outcome of a round (outcome.py). A round is three calls, so that the
exchange can run in the background while the next inner phase trains: ``begin`` (Δ,
encoded), ``exchange`` (network only, touches no model state) and ``finish`` (apply, load
into the model). ``sync`` does all three.

The run's settings (H, fragments, codecs, merge, mode: diloco.sync.RunSettings) are the
coordinator's: ``join`` states what this site's own configuration set explicitly (a
coordinator with other values refuses it, naming the key) and takes the run's from the answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from diloco.boxes import Box
from diloco.codec import get_codec, is_lossless
from diloco.outer import ErrorFeedback, apply_update, nonfinite_count, params_sha256, pseudo_gradient
from diloco.outer.eager import EagerStart
from diloco.outer.fragments import fragment_of_round, split_fragments
from diloco.site.exchange import assemble, exchange
from diloco.site.heartbeat import Heartbeat
from diloco.site.host_copy import HostMirror
from diloco.site.layouts.base import ParallelModel
from diloco.site.local_model import LocalModel
from diloco.site.merge import Delta, Mix, merge_for
from diloco.site.outcome import RoundOutcome
from diloco.site.phase_start import Delayed, FromGlobal, phase_start
from diloco.site.stats import SyncStats
from diloco.site.stripes import StripedPull, encode_parts, stripe_boxes
from diloco.site.sync_types import PendingRound, SyncOptions
from diloco.sync import RunSettings
from diloco.transport import CoordinatorClient, retrying
from diloco.types import Chunk, JoinInfo, JoinRequest, PushHeader, SiteEval
from diloco.wire import ChunkAssembler, SliceAssembler, encode_chunks


class OuterSync:
    """Keeps this site's copy of the global parameters θ and syncs the model with it.

    The model's parameters are the local θ^s; after ``sync`` they are overwritten with the
    new global θ (the inner optimizer's state is left alone: it stays with the site).
    ``stats.round_hashes`` records the hash of the site's θ after each round it took part in.

    A round whose Δ is not finite (the inner phase diverged: an overflow, a bad batch) is
    withheld (PushHeader.withheld says why): the round goes on without it, the site loads θ
    whole and ``on_diverged`` (the caller's: reset the inner optimizer's state, which the NaN
    reached too) runs before it trains again; ``stats.diverged_rounds`` lists those rounds.
    """

    def __init__(
        self,
        model: nn.Module | ParallelModel,
        client: CoordinatorClient,
        site_id: str,
        options: SyncOptions | None = None,
        *,
        before_push: Callable[[int], None] | None = None,
        on_diverged: Callable[[], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.site_id = site_id
        self.options = options or SyncOptions()
        self.on_diverged = on_diverged
        self.before_push = before_push  # a hook called with the round before each push (fault injection)
        self._log = log or (lambda _msg: None)
        # The model as laid out over the site's ranks; a plain module is a one-rank site.
        self.layout = model if isinstance(model, ParallelModel) else ParallelModel(model)
        self.model = model  # the caller's module (or its layout)
        self.local = LocalModel(self.layout)  # this rank's parameters, as the sync reads and writes them
        self._specs = self.layout.specs
        self._boxes = {n: h.box for n, h in self.layout.held().items()}  # the slices this rank syncs
        whole = self.layout.world == 1 and all(b.is_whole(self._specs[n].shape) for n, b in self._boxes.items())
        self._want = None if whole else dict(self._boxes)  # pulls: everything, or only these slices
        self.global_params: dict[str, torch.Tensor] = {}  # this rank's slices of the global θ
        self.round = 0
        self.total_rounds = 0
        self.stats = SyncStats()
        self._heartbeat: Heartbeat | None = None
        self.eval_every = 0  # evaluation by sites: the coordinator's JoinInfo.eval_every
        self._eval: SiteEval | None = None  # an evaluation to report with the next push (or leave)
        self.uploaded_init = False  # this site sent θ₀ (init=site)
        # Set at the first join, from the run's settings (``_configure``).
        self.settings: RunSettings = self.options.settings
        self.split: tuple[tuple[str, ...], ...] = ()
        self.codec = self.settings.codec.build()
        self.feedback: ErrorFeedback | None = None
        self._lookahead: EagerStart | None = None  # the outer step in flight, looked ahead (eager, merge=ahead)
        self._merge: Mix | Delta = Mix(0.0)
        self._start: FromGlobal | Delayed = FromGlobal()
        self._configured = False

    @property
    def residual(self) -> dict[str, torch.Tensor] | None:
        """The uplink error-feedback residual (what the codec has not delivered yet)."""
        return self.feedback.residual if self.feedback is not None else None

    def set_residual(self, residual: dict[str, torch.Tensor] | None) -> None:
        if self.feedback is not None:
            self.feedback.carry(residual)

    @property
    def finished(self) -> bool:
        return self.round >= self.total_rounds

    # ---- joining -------------------------------------------------------------------------
    def join(self) -> JoinInfo:
        """Registers with the coordinator (the site's leader rank, for the site: the other ranks
        take its answer), takes the run's settings, loads the global θ (each rank its slices)
        into the model and starts heartbeats (three per lease, from the leader). If the
        coordinator has no θ₀ yet (init=site) and chose this site as its source, the site first
        uploads its own parameters."""
        info = self.layout.from_leader(self._join)
        if info.upload_init:
            # θ₀ is installed once every rank's part has arrived: no rank pulls before the others
            # have sent theirs, and a rank whose part failed makes every rank raise, none wait.
            self.layout.on_every_rank(self._upload_init, f"site {self.site_id}: θ₀ was not sent")
        self.total_rounds = info.total_rounds
        self.eval_every = info.eval_every
        self._configure(info)
        self._retrying(self._pull_global, "pull of θ")  # a fresh run's first pull waits for every site
        if self._heartbeat is None and info.lease_s > 0 and self.layout.leader:
            self._heartbeat = Heartbeat(self.client, self.site_id, info.lease_s / 3, self._log)
        return info

    def _join(self) -> JoinInfo:
        """Join, stating what this site's configuration set explicitly; while another site is
        sending θ₀ (init=site) the coordinator answers unavailable, and the site asks again with
        backoff, for as long as it would wait for a round (a large θ₀ takes a while to upload)."""
        t = self.options.timeouts
        stated = self.options.settings.stated(self.options.stated) if self.options.stated else {}
        request = JoinRequest(self.site_id, tuple(self._specs.values()), can_upload=True, stated=stated)
        return retrying(
            lambda: self.client.join(request), limit_s=max(t.reconnect_timeout_s, t.round_timeout_s), what=f"site {self.site_id} join", log=self._log
        )

    def _configure(self, info: JoinInfo) -> None:
        """The run's settings from the coordinator's answer (the site's own where it owns none,
        and the site's own ``sync.streams`` always), and what follows from them: the codec, the
        error feedback, the split, the merge and where phases start. Once: a site joining again
        keeps its residual and look-ahead, and the run's settings cannot have changed."""
        own = self.options.settings
        settings = own
        if info.settings is not None:
            run = RunSettings.from_dict(info.settings)
            settings = dataclasses.replace(run, sync=dataclasses.replace(run.sync, streams=own.sync.streams))
        if self._configured:
            if settings != self.settings:
                raise RuntimeError(f"site {self.site_id}: the run's settings changed between two joins (a coordinator of another run?)")
            return
        self.settings = s = settings
        self.codec = s.codec.build()
        self.feedback = ErrorFeedback(s.error_feedback_decay) if s.error_feedback and not is_lossless(self.codec.name) else None
        # The coordinator's split; before θ₀ exists (this site sends it) the same function of
        # the parameters this site sends, as the coordinator computes it from them.
        self.split = info.fragments or split_fragments({n: sp.shape for n, sp in self._specs.items()}, s.sync.fragments, s.sync.split)
        if len(self.split) != s.sync.fragments:
            raise RuntimeError(f"site {self.site_id}: the coordinator's split has {len(self.split)} fragments, the run {s.sync.fragments}")
        if s.sync.looks_ahead:
            f = s.sync.fragments
            self._lookahead = EagerStart(s.outer_step, -(-info.total_rounds // f), s.sync.own_weight, fragments=f)
        self._merge = merge_for(s.sync.merge, float(s.sync.local_weight or 0.0), self._lookahead)
        self._start = phase_start(s.sync.mode, self._lookahead)
        self._configured = True

    def _upload_init(self) -> None:
        """Sends this site's parameters as θ₀ (float32, lossless, the framing of a push); the
        ranks of a multi-rank site each send the slices they push, as one part of it."""
        pushed = {n: h for n, h in self.layout.held().items() if h.push}
        values = self.local.values(pushed)
        boxes = None if self.layout.world == 1 else {n: (h.box, self._specs[n].shape) for n, h in pushed.items()}
        chunks = encode_chunks(values, codec=get_codec("fp32"), chunk_bytes=self.options.chunk_bytes, boxes=boxes)
        header = PushHeader(site_id=self.site_id, round=0, tokens=1, train_loss=math.nan, inner_steps=0, part=self.layout.rank, parts=self.layout.world)
        result = self.client.upload_init(header, chunks)
        self.stats.bytes_up += result.payload_bytes
        self.uploaded_init = True
        self._log(f"site {self.site_id}: sent its parameters as θ₀ ({result.payload_bytes} bytes)")

    def report_eval(self, round: int, loss: float, tokens: int) -> None:
        """The site's held-out loss (nats per token, over ``tokens``) of the global θ after
        ``round``: sent with the next push, or when the site leaves."""
        if not (math.isfinite(loss) and tokens > 0):
            self._log(f"site {self.site_id}: its evaluation of round {round} is not reportable (loss {loss}, {tokens} tokens); skipped")
            return
        self._eval = SiteEval(round=round, loss=float(loss), tokens=int(tokens))

    def close(self) -> None:
        """Stops the heartbeats (leave() does this too)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def _assembler(self, names: tuple[str, ...] | None = None) -> ChunkAssembler | SliceAssembler:
        """For θ whole (``names`` None) or a round's update (its fragment's tensors)."""
        if self._want is None:
            return ChunkAssembler(self._specs if names is None else {n: self._specs[n] for n in names})
        return SliceAssembler(self._specs, self._want if names is None else self._round_want(names))

    def _round_want(self, names: tuple[str, ...]) -> dict[str, Box]:
        assert self._want is not None
        return {n: b for n, b in self._want.items() if n in names}

    def names_of(self, round: int) -> tuple[str, ...]:
        """The parameters round ``round`` syncs: all of them, or its fragment's."""
        return self.split[fragment_of_round(round, self.settings.sync.fragments)]

    def _pull_global(self) -> None:
        """θ whole (this rank's slices); a site that looks ahead of the outer step pulls the
        coordinator's momentum of the same round with it (none before the first outer step)."""
        momentum: list[Chunk] = []
        if self._lookahead is not None:
            status, chunks, momentum = self.client.pull_global_with_state(self.site_id, self._want)
        else:
            status, chunks = self.client.pull_global(self.site_id, self._want)
        assembler = assemble(chunks, self._assembler())
        self.global_params = HostMirror.keep(assembler.finish(), self.local.on_device)
        self.stats.bytes_down += assembler.payload_bytes
        if momentum:
            assert self._lookahead is not None
            buffers = assemble(momentum, self._assembler())
            self._lookahead.follow(buffers.finish())
            self.stats.bytes_down += buffers.payload_bytes
            self.stats.momentum_pulled.append(status.committed_rounds - 1)
            self._log(f"site {self.site_id}: looks ahead from the coordinator's outer momentum after round {status.committed_rounds - 1} (pulled with θ)")
        self.round = status.committed_rounds
        self._load_global()
        if self.round > 0 and self._want is None:
            self.stats.round_hashes[self.round - 1] = params_sha256(self.global_params)

    def _load_global(self) -> None:
        """The model ← θ whole; a phase that starts from its own point starts here."""
        self.local.load(self.global_params)
        self._start.after_load(self.local)

    def restart_phase(self, pending: PendingRound) -> None:
        """sync.mode delayed/eager, right after pushing ``pending`` without waiting for it: the
        next inner phase starts from its start point (phase_start.py). After a diverged round
        (no Δ) it starts from θ."""
        self._start.restart(self.global_params, pending.header.round, pending.delta, self.local)
        if pending.diverged:
            self._restart_from_global(pending.header.round)

    @contextlib.contextmanager
    def holding_global(self) -> Iterator[None]:
        """The model holds θ inside the block (to evaluate it) and its own values again after."""
        saved = self.local.copy()
        self.local.load(self.global_params)
        try:
            yield
        finally:
            self.local.load(saved)

    def load_global(self) -> None:
        """The model ← θ whole (the end of a run whose last phase started elsewhere)."""
        self._load_global()

    # ---- a round -------------------------------------------------------------------------
    def sync(self, *, tokens: int, train_loss: float, inner_steps: int) -> str:
        """Ends this site's round: pushes Δ = θ − θ^s, waits for the commit, applies u.

        Blocks until the round is committed. Returns the hash of this rank's global θ.
        If the round was committed without this push (it came too late), or the site was
        evicted (its lease ran out), the site drops this round's work, pulls θ whole (joining
        again if it must) and goes on from the open round. The ranks of a sharded site each
        push their own slices as one part of the site's push, and agree on the outcome.
        """
        return self.finish(self.exchange(self.begin(tokens=tokens, train_loss=train_loss, inner_steps=inner_steps)))

    def begin(self, *, tokens: int, train_loss: float, inner_steps: int, round: int | None = None) -> PendingRound:
        """Δ of this round (with the error feedback), encoded, and the header of its push.
        ``round``: a later round than the open one, pushed before the rounds in flight land (a
        streaming run's flush rounds: their fragments are not the ones in flight)."""
        r = self.round if round is None else round
        t0 = time.perf_counter()
        names = self.names_of(r)
        pushed = {n: h for n, h in self.layout.held().items() if h.push and n in names}
        local = self.local.values(pushed)
        reference = self._start.reference(self.global_params)
        delta = pseudo_gradient({n: reference[n] for n in pushed}, local)
        bad = nonfinite_count(delta)
        if self.layout.agree(1 if bad else 0):  # every rank of the site withholds, or none
            return self._withheld(r, names, bad, tokens, inner_steps, t0)
        if not math.isfinite(train_loss):
            train_loss = math.nan  # not reported (an infinite loss would make the header invalid)
        own = {n: d.clone() for n, d in delta.items()} if self._start.keeps_own_delta else None
        at_push = self._merge.at_push(self.local, r, names, reference)  # what the merge re-applies after the round lands
        if self.feedback is not None:
            delta = self.feedback.compensate(delta)
        t1 = time.perf_counter()
        header = PushHeader(
            site_id=self.site_id, round=r, tokens=tokens, train_loss=train_loss, inner_steps=inner_steps, part=self.layout.rank, parts=self.layout.world,
            eval=self._eval if self.layout.leader else None,
        )  # fmt: skip
        parts = self._encode_parts(header, delta, {n: h.box for n, h in pushed.items()})
        chunks = [c for _, part in parts for c in part]
        residual = None
        if self.feedback is not None:
            sent = (
                ChunkAssembler({n: self._specs[n] for n in pushed})
                if self._want is None
                else SliceAssembler(self._specs, {n: h.box for n, h in pushed.items()})
            )
            residual = ErrorFeedback.error(delta, assemble(chunks, sent).finish())
        times = {"round": r, "delta_s": t1 - t0, "encode_s": time.perf_counter() - t1, "push_s": 0.0, "wait_s": 0.0, "pull_s": 0.0}
        return PendingRound(header, chunks, residual, times, names=names, delta=own, parts=parts, at_push=at_push)

    def _withheld(self, r: int, names: tuple[str, ...], bad: int, tokens: int, inner_steps: int, t0: float) -> PendingRound:
        """The push of a round whose Δ is not finite: a header saying so, no chunks. Every rank
        sends the same one-part header (the coordinator counts the first, the rest are
        duplicates); the uplink residual stays as it was."""
        where = f"{bad} values on rank {self.layout.rank}" if bad else "on another rank of the site"
        why = f"its pseudo-gradient is not finite ({where}; the inner phase diverged): it restarts from θ"
        self._log(f"site {self.site_id}: round {r}: {why}")
        header = PushHeader(site_id=self.site_id, round=r, tokens=tokens, train_loss=math.nan, inner_steps=inner_steps, withheld=why)
        times = {"round": r, "delta_s": time.perf_counter() - t0, "encode_s": 0.0, "push_s": 0.0, "wait_s": 0.0, "pull_s": 0.0}
        return PendingRound(header, [], None, times, names=names, parts=[(header, [])], diverged=True)

    def _restart_from_global(self, r: int) -> None:
        """After a diverged round: the model is θ again; the caller resets what else the NaN reached."""
        self.stats.diverged_rounds.append(r)
        if self.on_diverged is not None:
            self.on_diverged()

    @property
    def _streams(self) -> int:
        return self.settings.sync.streams

    def _encode_parts(self, header: PushHeader, delta: dict[str, torch.Tensor], held: dict[str, Box]) -> list[tuple[PushHeader, list[Chunk]]]:
        return encode_parts(header, delta, held, self._specs, self.codec, self.options.chunk_bytes, self._streams, split_rows=self.layout.world == 1)

    def _pull_plan(self, names: tuple[str, ...]) -> tuple[list[dict[str, Box] | None], Callable[[], Any]]:
        """What each pull stream asks for, and the assembler they fill."""
        if self._streams == 1:
            want = None if self._want is None else self._round_want(names)
            return [want], lambda: self._assembler(names)
        held = {n: Box.whole(self._specs[n].shape) for n in names} if self._want is None else self._round_want(names)
        stripes = [s for s in stripe_boxes(held, {n: self._specs[n].shape for n in held}, self._streams, split_rows=self._want is None) if s]
        return list(stripes), lambda: StripedPull(self._specs, stripes, held)

    def exchange(self, pending: PendingRound, on_committed: Callable[[], None] | None = None) -> PendingRound:
        """Push, wait, pull: the network part of a round. Reads and writes no model state, so it
        may run on another thread while the next inner phase trains; ``on_committed`` is called
        when the round is committed, before the pull."""
        if self.before_push is not None:
            self.before_push(pending.header.round)
        pulls, assembler = self._pull_plan(pending.names)
        pending.outcome, pending.update = exchange(
            self.client,
            pending.parts or [(pending.header, pending.chunks)],
            pulls,
            assembler,
            self.options.timeouts,
            self.stats,
            pending.times,
            self._log,
            on_committed,
        )
        return pending

    def finish(self, pending: PendingRound) -> str:
        """Applies the round's update (or catches up) once every rank of the site agrees on how
        the round went; returns the hash of this rank's global θ."""
        assert pending.outcome is not None, "finish() needs a round that went through exchange()"
        r = pending.header.round
        outcome = pending.outcome.agreed(self.layout.agree(pending.outcome.bits()))  # every rank goes the same way
        self._eval = None  # sent (or, if the push did not count, a stale evaluation: dropped)
        if r != self.round:  # pipelined after a round that caught up: θ as pulled then holds this one, or is pulled again
            return self._catch_up(r, RoundOutcome(catch_up=True)) if r > self.round else params_sha256(self.global_params)
        if self.feedback is not None and not outcome.dropped and not outcome.refused and not pending.diverged:
            self.feedback.carry(pending.residual)  # only a push that counted moves the residual on
        if not outcome.applied:
            digest = self._catch_up(r, outcome)  # θ whole into the model
            if pending.diverged and not self._start.overlaps_phase:
                self._restart_from_global(r)
            return digest
        assert pending.update is not None
        t3 = time.perf_counter()
        update = pending.update.finish()
        apply_update(self.global_params, update)
        if self._lookahead is not None:
            self._lookahead.observe(r, update)
        self.stats.bytes_down += pending.update.payload_bytes
        pending.times["bytes_down"] = pending.update.payload_bytes
        if pending.diverged and not self._start.overlaps_phase:  # the whole model from θ, nothing of the local values kept
            self.local.load(self.global_params)
            self._restart_from_global(r)
        elif not self._start.overlaps_phase:  # else the model is mid-phase from its own start point (restart_phase)
            whole = self.settings.sync.fragments == 1
            self._merge.land(self.local, self.global_params, None if whole else pending.names, pending.at_push)
        pending.times["apply_s"] = time.perf_counter() - t3  # decoding happened as the chunks arrived (pull_s)
        self.stats.timings.append(pending.times)
        self.round = r + 1
        digest = params_sha256(self.global_params)
        if self._want is None:
            self.stats.round_hashes[r] = digest
        return digest

    def _catch_up(self, r: int, outcome: RoundOutcome) -> str:
        """Loads θ whole (this rank's slices of it), the site's leader joining again first when
        the coordinator asked for it."""
        if self._lookahead is not None:
            self._lookahead.missed(r, self.names_of(r))
        if outcome.merged:
            self.stats.merged_rounds.append(r)
        if outcome.dropped:
            self.stats.dropped_rounds.append(r)
        if outcome.why is not None:
            self._log(f"site {self.site_id}: {outcome.why.message}" + ("; joining again" if outcome.rejoin else ""))
        if outcome.rejoin:
            self.stats.rejoins += 1
            if self.layout.leader:
                self._retrying(lambda: self._configure(self._join()), "join")
            self.layout.barrier()
        self._retrying(self._pull_global, "pull of θ")
        return params_sha256(self.global_params)

    def _retrying(self, fn: Callable[[], object], what: str) -> object:
        """fn(), made again with backoff while the coordinator cannot be reached."""
        limit = self.options.timeouts.reconnect_timeout_s
        return retrying(fn, limit_s=limit, what=f"site {self.site_id} {what}", log=self._log, on_retry=self.stats.retried)

    def global_sha256(self) -> str:
        return params_sha256(self.global_params)

    def leave(self, global_sha256: str | None = None) -> None:
        """Says goodbye for the site (its leader rank), reporting the hash of its whole θ."""
        self.close()
        digest = global_sha256 or self.global_sha256()
        self._retrying(lambda: self.client.leave(self.site_id, digest, self._eval), "leave")
