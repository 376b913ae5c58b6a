"""A site's half of the outer loop: join, push Δ, wait for the round, pull and apply u.

The pieces: the protocol steps and their retries (exchange.py), the uplink error feedback
(diloco.outer.ErrorFeedback), the counters (stats.py) and the outcome of a round
(outcome.py). A round is three calls, so that the exchange can run in the background while
the next inner phase trains: ``begin`` (Δ, encoded), ``exchange`` (network only, touches no
model state) and ``finish`` (apply, load into the model). ``sync`` does all three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diloco.boxes import Box
from diloco.codec import CodecConfig, best_settings, codec_config, get_codec, is_lossless
from diloco.outer import ErrorFeedback, OuterConfig, apply_update, nonfinite_count, params_sha256, pseudo_gradient
from diloco.outer.eager import EAGER_WEIGHT, EagerStart, check_eager_outer
from diloco.outer.fragments import fragment_of_round, split_fragments
from diloco.site.exchange import Assembler, Timeouts, assemble, exchange
from diloco.site.heartbeat import Heartbeat
from diloco.site.host_copy import HostMirror
from diloco.site.layouts.base import ParallelModel
from diloco.site.outcome import RoundOutcome
from diloco.site.stats import SyncStats
from diloco.site.stripes import StripedPull, box_values, stripe_boxes
from diloco.transport import CoordinatorClient, retrying
from diloco.types import Chunk, JoinInfo, PushHeader, SiteEval
from diloco.wire import MAX_CHUNK_BYTES, ChunkAssembler, SliceAssembler, encode_chunks


@dataclass(frozen=True)
class SyncOptions:
    codec: CodecConfig | str = "fp32"  # the uplink's encoding of Δ
    error_feedback: bool = True  # carry the codec's error into the next Δ (lossy codecs only)
    error_feedback_decay: float | None = None  # β: the share of the last residual added to the next Δ; None: the codec's best
    chunk_bytes: int = MAX_CHUNK_BYTES
    sync_every: int = 0  # told to the coordinator at Join (0: not said), which refuses another H
    timeouts: Timeouts = field(default_factory=Timeouts)
    fragments: int = 1  # streaming: round r syncs fragment r mod F (told at Join; the coordinator refuses another F)
    fragment_split: str = "strided"  # how the parameters split into fragments (diloco.outer.fragments.SPLITS; told at Join too)
    alpha: float = 0.0  # a landed fragment is merged into the model as α·local + (1−α)·global (0: replaced)
    # "alpha": the merge above; "delta": θ + the local steps taken since the push (local −
    # local at the push), so the overlapped steps are neither lost nor counted twice; "ahead":
    # delta, with the overlapped steps taken from a look-ahead of the outer step in flight (the
    # fragment moved by the coordinator's momentum, and by eager_weight × the site's own Δ in
    # place of the mean: diloco.outer.eager), so they start nearer where the merge puts them.
    merge: str = "alpha"
    # Where each round's Δ is measured from: "global" (θ, DiLoCo and streaming), or the inner
    # phase's own start point, which the site sets when it pushes without waiting for the
    # round: "delayed" (θ as known then, one round old) or "eager" (that θ plus what the outer
    # step makes of the site's own Δ, weighted eager_weight, in place of the average still in
    # flight: diloco.outer.eager).
    start_point: str = "global"
    outer: OuterConfig | None = None  # eager, merge=ahead: the run's outer step, which the look-ahead follows
    eager_weight: float = EAGER_WEIGHT  # eager, merge=ahead: the own Δ's weight in the stand-in for the mean in flight
    streams: int = 1  # connection striping: each push and pull over this many concurrent streams (the client needs as many)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha!r}: must be in [0, 1]")
        if self.merge not in ("alpha", "delta", "ahead"):
            raise ValueError(f"merge={self.merge!r}: must be alpha, delta or ahead")
        if self.start_point not in ("global", "delayed", "eager"):
            raise ValueError(f"start_point={self.start_point!r}: must be global, delayed or eager")
        if self.start_point == "eager" or self.merge == "ahead":
            what = "start_point=eager" if self.start_point == "eager" else "merge=ahead"
            if self.outer is None:
                raise ValueError(f"{what} needs the run's outer step (SyncOptions.outer)")
            check_eager_outer(self.outer, what)
            if not 0 <= self.eager_weight <= 1:
                raise ValueError(f"eager_weight={self.eager_weight}: must be in [0, 1]")
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or self.streams < 1:
            raise ValueError(f"streams={self.streams!r}: must be an integer >= 1")


@dataclass
class PendingRound:
    """A round between ``begin`` and ``finish``: what is pushed, and (after ``exchange``) how
    it went."""

    header: PushHeader
    chunks: list[Chunk]
    residual: dict[str, torch.Tensor] | None  # the uplink error if this push counts
    times: dict[str, float]
    names: tuple[str, ...] = ()  # the parameters this round syncs (its fragment's)
    parts: list[tuple[PushHeader, list[Chunk]]] = field(default_factory=list)  # striped: the push's parts, one per stream
    delta: dict[str, torch.Tensor] | None = None  # the site's own Δ (kept for an eager start point)
    at_push: dict[str, torch.Tensor] | None = None  # merge=delta/ahead: the fragment's local values when it was pushed (ahead: looked ahead)
    outcome: RoundOutcome | None = None
    update: Assembler | None = None
    diverged: bool = False  # Δ was not finite: the push is withheld and the site restarts from θ


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
        self.model = model
        self.on_diverged = on_diverged
        self.client = client
        self.site_id = site_id
        self.options = opts = options or SyncOptions()
        self.codec = codec_config(opts.codec).build()
        # Uplink error feedback: what the codec dropped this round is added to the next Δ.
        decay = opts.error_feedback_decay if opts.error_feedback_decay is not None else float(best_settings(self.codec.name)["error_feedback_decay"])  # type: ignore[arg-type]
        self.feedback = ErrorFeedback(decay) if opts.error_feedback and not is_lossless(self.codec.name) else None
        self.before_push = before_push  # a hook called with the round before each push (fault injection)
        self._log = log or (lambda _msg: None)
        # The model as laid out over the site's ranks; a plain module is a one-rank site.
        self.layout = model if isinstance(model, ParallelModel) else ParallelModel(model)
        self._specs = self.layout.specs
        held = self.layout.held()
        self._boxes = {n: h.box for n, h in held.items()}  # the slices this rank syncs
        whole = self.layout.world == 1 and all(b.is_whole(self._specs[n].shape) for n, b in self._boxes.items())
        self._want = None if whole else dict(self._boxes)  # pulls: everything, or only these slices
        self.global_params: dict[str, torch.Tensor] = {}  # this rank's slices of the global θ
        self.round = 0
        self.total_rounds = 0
        self.stats = SyncStats()
        self._heartbeat: Heartbeat | None = None
        # The model may train on a GPU; θ, Δ and the wire stay on the host (see host_copy).
        self._host = HostMirror()
        self._on_device = HostMirror.on_device({n: h.tensor for n, h in held.items()})
        self.eval_every = 0  # evaluation by sites: the coordinator's JoinInfo.eval_every
        self._eval: SiteEval | None = None  # an evaluation to report with the next push (or leave)
        self.uploaded_init = False  # this site sent θ₀ (init=site)
        self.split = split_fragments({n: s.shape for n, s in self._specs.items()}, opts.fragments, opts.fragment_split)
        self._start: dict[str, torch.Tensor] | None = None  # the inner phase's start point (start_point delayed/eager)
        self._lookahead: EagerStart | None = None  # eager: the outer step in flight, looked ahead

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
        """Registers with the coordinator (every rank of the site, under the site's id), loads
        the global θ (this rank's slices) into the model and starts heartbeats (three per
        lease, from the site's leader rank). If the coordinator has no θ₀ yet (init=site) and
        chose this site as its source, the site first uploads its own parameters."""
        info = self._join()
        self.total_rounds = info.total_rounds
        self.eval_every = info.eval_every
        if info.upload_init:
            self._upload_init()
        self._retrying(self._pull_global, "pull of θ")  # a fresh run's first pull waits for every site
        if self._heartbeat is None and info.lease_s > 0 and self.layout.leader:
            self._heartbeat = Heartbeat(self.client, self.site_id, info.lease_s / 3, self._log)
        return info

    def _join(self) -> JoinInfo:
        """Join, saying what must agree with the coordinator; while another site is sending θ₀
        (init=site) the coordinator answers unavailable, and the site asks again with backoff,
        for as long as it would wait for a round (a large θ₀ takes a while to upload)."""
        t = self.options.timeouts
        can_upload = self.layout.world == 1  # θ₀ is sent whole, by a one-rank site

        def join() -> JoinInfo:
            return self.client.join(
                self.site_id, self._specs.values(), can_upload=can_upload, sync_every=self.options.sync_every, codec=self.codec.name, fragments=self.options.fragments,
                fragment_split=self.options.fragment_split if self.options.fragments > 1 else "",
            )  # fmt: skip

        return retrying(join, limit_s=max(t.reconnect_timeout_s, t.round_timeout_s), what=f"site {self.site_id} join", log=self._log)

    def _upload_init(self) -> None:
        """Sends this site's parameters as θ₀ (float32, lossless, the framing of a push)."""
        params = self._host.host({n: h.tensor for n, h in self.layout.held().items()})
        chunks = encode_chunks(params, codec=get_codec("fp32"), chunk_bytes=self.options.chunk_bytes)
        header = PushHeader(site_id=self.site_id, round=0, tokens=1, train_loss=math.nan, inner_steps=0)
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

    def _round_want(self, names: tuple[str, ...]) -> dict:
        assert self._want is not None
        return {n: b for n, b in self._want.items() if n in names}

    def names_of(self, round: int) -> tuple[str, ...]:
        """The parameters round ``round`` syncs: all of them, or its fragment's."""
        return self.split[fragment_of_round(round, self.options.fragments)]

    def _pull_global(self) -> None:
        """θ whole (this rank's slices); a site that looks ahead of the outer step pulls the
        coordinator's momentum of the same round with it (none before the first outer step)."""
        momentum: list = []
        if self._looks_ahead:
            status, chunks, momentum = self.client.pull_global_with_state(self.site_id, self._want)
        else:
            status, chunks = self.client.pull_global(self.site_id, self._want)
        assembler = assemble(chunks, self._assembler())
        self.global_params = HostMirror.keep(assembler.finish(), self._on_device)
        self.stats.bytes_down += assembler.payload_bytes
        if momentum:
            buffers = assemble(momentum, self._assembler())
            self._eager().follow(buffers.finish())
            self.stats.bytes_down += buffers.payload_bytes
            self._log(f"site {self.site_id}: looks ahead from the coordinator's outer momentum after round {status.committed_rounds - 1} (pulled with θ)")
        self.round = status.committed_rounds
        self._load_global_into_model()
        self._start = self._host_copy_of_model() if self.options.start_point != "global" else None
        if self.round > 0 and self._want is None:
            self.stats.round_hashes[self.round - 1] = params_sha256(self.global_params)

    def _load_global_into_model(self, names: tuple[str, ...] | None = None, alpha: float = 0.0, at_push: dict[str, torch.Tensor] | None = None) -> None:
        """The model's parameters (``names``: only those) ← θ; with ``alpha`` > 0 the merge
        α·local + (1−α)·θ (streaming DiLoCo's); with ``at_push`` (merge=delta) θ + (local −
        at_push): the steps trained since the push, on top of θ. The site's θ stays exact."""
        held = {n: h.tensor for n, h in self.layout.held().items() if names is None or n in names}
        values = {n: self.global_params[n] for n in held}
        if at_push is not None:
            local = self._host.host(held)
            values = {n: values[n] + (local[n].float() - at_push[n]) for n in held}
        elif alpha > 0:
            local = self._host.host(held)
            values = {n: torch.lerp(values[n], local[n].float(), alpha) for n in held}
        HostMirror.load(held, values)
        self.layout.after_pull()

    def _host_copy_of_model(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self._host.host({n: h.tensor for n, h in self.layout.held().items()}).items()}

    def restart_phase(self, pending: PendingRound) -> None:
        """start_point delayed/eager, right after pushing ``pending`` without waiting for it: the
        next inner phase starts from θ as known now (delayed), or from θ moved by the outer step
        still in flight, looked ahead with the site's own Δ standing in for (a share of) the
        mean (eager: diloco.outer.eager). After a diverged round (no Δ) it starts from θ."""
        mode = self.options.start_point
        assert mode in ("delayed", "eager") and (mode == "delayed" or pending.delta is not None or pending.diverged)
        start = {n: t.clone() for n, t in self.global_params.items()}
        if mode == "eager" and pending.delta is not None:
            for n, o in self._eager().offset(pending.header.round, pending.delta).items():
                start[n].add_(o)
        held = {n: h.tensor for n, h in self.layout.held().items()}
        HostMirror.load(held, start)
        self.layout.after_pull()
        self._start = start
        if pending.diverged:
            self._restart_from_global(pending.header.round)

    @property
    def _looks_ahead(self) -> bool:
        return self.options.start_point == "eager" or self.options.merge == "ahead"

    def _eager(self) -> EagerStart:
        if self._lookahead is None:
            assert self.options.outer is not None
            f = self.options.fragments
            self._lookahead = EagerStart(self.options.outer, -(-self.total_rounds // f), self.options.eager_weight, fragments=f)
        return self._lookahead

    @contextlib.contextmanager
    def holding_global(self) -> Iterator[None]:
        """The model holds θ inside the block (to evaluate it) and its own values again after."""
        held = {n: h.tensor for n, h in self.layout.held().items()}
        saved = self._host_copy_of_model()
        HostMirror.load(held, self.global_params)
        try:
            yield
        finally:
            HostMirror.load(held, saved)

    def load_global(self) -> None:
        """The model ← θ whole (the end of a run whose last phase started elsewhere)."""
        self._load_global_into_model()
        self._start = self._host_copy_of_model() if self.options.start_point != "global" else None

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
        local = self._host.host({n: h.tensor for n, h in pushed.items()})
        reference = self.global_params if self._start is None else self._start
        delta = pseudo_gradient({n: reference[n] for n in pushed}, local)
        bad = nonfinite_count(delta)
        if self.layout.agree(1 if bad else 0):  # every rank of the site withholds, or none
            return self._withheld(r, names, bad, tokens, inner_steps, t0)
        if not math.isfinite(train_loss):
            train_loss = math.nan  # not reported (an infinite loss would make the header invalid)
        own = {n: d.clone() for n, d in delta.items()} if self.options.start_point == "eager" else None
        at_push = None
        if self.options.merge in ("delta", "ahead"):  # the fragment's local values now, to re-apply the steps trained until the merge
            at_push = self._at_push(r, names, reference)
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

    def _at_push(self, r: int, names: tuple[str, ...], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fragment's local values as the overlapped steps start from them: as they are
        (merge=delta), or moved by the look-ahead of round ``r``'s outer step (merge=ahead; every
        rank holding a slice computes the same offset from the same values, so replicas agree)."""
        held = {n: h.tensor for n, h in self.layout.held().items() if n in names}
        local = {n: t.detach().float().clone() for n, t in self._host.host(held).items()}
        if self.options.merge == "ahead":
            own = pseudo_gradient({n: reference[n] for n in held}, local)
            for n, o in self._eager().offset(r, own).items():
                local[n].add_(o)
            HostMirror.load(held, local)
            self.layout.after_pull()
            local = {n: t.detach().float().clone() for n, t in self._host.host(held).items()}  # as the model holds them (a bf16 model rounds)
        return local

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

    def _encode_parts(self, header: PushHeader, delta: dict[str, torch.Tensor], held: dict[str, Box]) -> list[tuple[PushHeader, list[Chunk]]]:
        """The push as one part per stream: Δ's slices striped over ``streams`` parts (numbered
        after the site's ranks' own: rank × k + i of world × k), each encoded on its own."""
        k = self.options.streams
        shapes = {n: self._specs[n].shape for n in held}
        if k == 1:
            boxes = {n: (held[n], shapes[n]) for n in held}
            return [(header, list(encode_chunks(delta, codec=self.codec, chunk_bytes=self.options.chunk_bytes, boxes=boxes)))]
        parts = []
        for i, stripe in enumerate(stripe_boxes(held, shapes, k, split_rows=self.layout.world == 1)):
            values = {n: box_values(delta[n], held[n], b) for n, b in stripe.items()}
            chunks = list(encode_chunks(values, codec=self.codec, chunk_bytes=self.options.chunk_bytes, boxes={n: (b, shapes[n]) for n, b in stripe.items()}))
            part = dataclasses.replace(header, part=header.part * k + i, parts=header.parts * k, eval=header.eval if i == 0 else None)
            parts.append((part, chunks))
        return parts

    def _pull_plan(self, names: tuple[str, ...]) -> tuple[list[dict[str, Box] | None], Callable[[], Any]]:
        """What each pull stream asks for, and the assembler they fill."""
        if self.options.streams == 1:
            want = None if self._want is None else self._round_want(names)
            return [want], lambda: self._assembler(names)
        held = {n: Box.whole(self._specs[n].shape) for n in names} if self._want is None else self._round_want(names)
        stripes = [s for s in stripe_boxes(held, {n: self._specs[n].shape for n in held}, self.options.streams, split_rows=self._want is None) if s]
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
            if pending.diverged and self._start is None:
                self._restart_from_global(r)
            return digest
        assert pending.update is not None
        t3 = time.perf_counter()
        update = pending.update.finish()
        apply_update(self.global_params, update)
        if self._looks_ahead:
            self._eager().observe(r, update)
        self.stats.bytes_down += pending.update.payload_bytes
        pending.times["bytes_down"] = pending.update.payload_bytes
        if self._start is None and pending.diverged:  # the whole model from θ, nothing of the local values kept
            self._load_global_into_model()
            self._restart_from_global(r)
        elif self._start is None:  # else the model is mid-phase from its own start point (restart_phase)
            whole = self.options.fragments == 1
            self._load_global_into_model(None if whole else pending.names, self.options.alpha, pending.at_push)
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
        if self._looks_ahead:
            self._eager().missed(r, self.names_of(r))
        if outcome.merged:
            self.stats.merged_rounds.append(r)
        if outcome.dropped:
            self.stats.dropped_rounds.append(r)
        if outcome.why is not None:
            self._log(f"site {self.site_id}: {outcome.why.message}" + ("; joining again" if outcome.rejoin else ""))
        if outcome.rejoin:
            self.stats.rejoins += 1
            if self.layout.leader:
                self._retrying(self._join, "join")
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
