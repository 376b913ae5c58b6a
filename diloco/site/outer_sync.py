"""A site's half of the outer loop: join, push Δ, wait for the round, pull and apply u."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from diloco.codec import ChunkAssembler, CodecConfig, SliceAssembler, codec_config, encode_chunks, get_codec, is_lossless
from diloco.codec.chunks import MAX_CHUNK_BYTES
from diloco.outer import apply_update, params_sha256, pseudo_gradient
from diloco.site.heartbeat import Heartbeat
from diloco.site.host_copy import HostMirror
from diloco.site.layouts.base import ParallelModel
from diloco.transport import CoordinatorClient, RemoteError
from diloco.types import JoinInfo, PushHeader, SiteEval


# The coordinator could not be reached (it is restarting, was stopped, or the network failed): retry.
RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")

# How a round ended for a site, as flags (the ranks of a site agree on their union); none set:
# the round's update was pulled and applied. Any set: the site pulls θ whole instead.
CATCH_UP = 1  # the push counted, but the update is gone (e.g. after a coordinator restart)
MERGED = 2  # the push came late and was merged into the open round
DROPPED = 4  # the round was committed without the push: its work did not count
REJOIN = 8  # the site was evicted (or forgotten): its leader joins again first


class _Backoff:
    """Exponential backoff (0.25 s doubling to 4 s) for at most ``limit_s`` in all."""

    def __init__(self, limit_s: float) -> None:
        self._give_up_at = time.monotonic() + limit_s
        self._delay = 0.25
        self._tries = 0

    def wait(self, error: RemoteError, log: Callable[[str], None], what: str) -> None:
        if time.monotonic() + self._delay > self._give_up_at:
            raise error
        if self._tries == 0:
            log(f"{what}: {error}; retrying with backoff")
        self._tries += 1
        time.sleep(self._delay)
        self._delay = min(2 * self._delay, 4.0)


def with_residual(delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], decay: float) -> dict[str, torch.Tensor]:
    """Δ + β × residual: what a site encodes with error feedback (β = 1: plain error
    feedback; β < 1 lets old residual fade, as SparseLoCo's error buffer does)."""
    if decay == 1.0:
        return {n: d + residual[n] for n, d in delta.items()}
    return {n: d + decay * residual[n] for n, d in delta.items()}


class OuterSync:
    """Keeps this site's copy of the global parameters θ and syncs the model with it.

    The model's parameters are the local θ^s; after ``sync`` they are overwritten with the
    new global θ (the inner optimizer's state is left alone: it stays with the site).
    ``round_hashes`` records the hash of the site's θ after each round it took part in.
    """

    def __init__(
        self,
        model: nn.Module | ParallelModel,
        client: CoordinatorClient,
        site_id: str,
        *,
        codec: CodecConfig | str = "fp32",
        error_feedback: bool = True,
        error_feedback_decay: float = 1.0,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        wait_poll_s: float = 30.0,
        round_timeout_s: float = 3600.0,
        reconnect_timeout_s: float = 300.0,
        before_push: Callable[[int], None] | None = None,
        log: Callable[[str], None] | None = None,
        sync_every: int = 0,
    ) -> None:
        self.model = model
        self.client = client
        self.site_id = site_id
        self.sync_every = sync_every  # told to the coordinator at Join (0: not said), which refuses another H
        self.codec = codec_config(codec).build()
        # Uplink error feedback: what the codec dropped this round is added to the next Δ.
        self.error_feedback = error_feedback and not is_lossless(self.codec.name)
        self.error_feedback_decay = error_feedback_decay
        self._residual: dict[str, torch.Tensor] | None = None
        self.chunk_bytes = chunk_bytes
        self.wait_poll_s = wait_poll_s
        self.round_timeout_s = round_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s  # give up when unreachable this long
        self.before_push = before_push  # a hook called with the round before each push (fault injection)
        self.reconnects = 0  # calls that failed because the coordinator could not be reached
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
        self.round_hashes: dict[int, str] = {}
        self.bytes_up = 0
        self.bytes_down = 0
        self.rejoins = 0  # times this site had to join again (evicted, or the coordinator forgot it)
        self.dropped_rounds: list[int] = []  # rounds committed without this site's push
        self.merged_rounds: list[int] = []  # rounds whose late push was merged into a later round
        # Seconds per applied round: computing Δ, encoding it, pushing, waiting for the round to
        # close, pulling (and decoding) the update, applying it and loading it into the model.
        self.timings: list[dict[str, float]] = []
        self._times: dict[str, float] = {}
        self._heartbeat: Heartbeat | None = None
        # The model may train on a GPU; θ, Δ and the wire stay on the host (see host_copy).
        self._host = HostMirror()
        self._on_device = HostMirror.on_device({n: h.tensor for n, h in held.items()})
        self.eval_every = 0  # evaluation by sites: the coordinator's JoinInfo.eval_every
        self._eval: SiteEval | None = None  # an evaluation to report with the next push (or leave)
        self.uploaded_init = False  # this site sent θ₀ (init=site)

    @property
    def residual(self) -> dict[str, torch.Tensor] | None:
        """The uplink error-feedback residual (what the codec has not delivered yet)."""
        return self._residual

    def set_residual(self, residual: dict[str, torch.Tensor] | None) -> None:
        self._residual = residual

    @property
    def finished(self) -> bool:
        return self.round >= self.total_rounds

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
        self._pull_global()
        if self._heartbeat is None and info.lease_s > 0 and self.layout.leader:
            self._heartbeat = Heartbeat(self.client, self.site_id, info.lease_s / 3, self._log)
        return info

    def _join(self) -> JoinInfo:
        """Join, saying what must agree with the coordinator; while another site is sending θ₀
        (init=site) the coordinator answers UNAVAILABLE, and the site asks again with backoff, for
        as long as it would wait for a round (a large θ₀ takes a while to upload)."""
        backoff = _Backoff(max(self.reconnect_timeout_s, self.round_timeout_s))
        can_upload = self.layout.world == 1  # θ₀ is sent whole, by a one-rank site
        while True:
            try:
                return self.client.join(self.site_id, self._specs.values(), can_upload=can_upload, sync_every=self.sync_every, codec=self.codec.name)
            except RemoteError as e:
                if e.code != "UNAVAILABLE":
                    raise
                backoff.wait(e, self._log, f"site {self.site_id} join")

    def _upload_init(self) -> None:
        """Sends this site's parameters as θ₀ (float32, lossless, the framing of a push)."""
        params = self._host.host({n: h.tensor for n, h in self.layout.held().items()})
        chunks = encode_chunks(params, codec=get_codec("fp32"), round=0, chunk_bytes=self.chunk_bytes)
        header = PushHeader(site_id=self.site_id, round=0, tokens=1, train_loss=math.nan, inner_steps=0)
        result = self.client.upload_init(header, chunks)
        self.bytes_up += result.payload_bytes
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

    def _assembler(self) -> ChunkAssembler | SliceAssembler:
        return ChunkAssembler(self._specs) if self._want is None else SliceAssembler(self._specs, self._want)

    def _pull_global(self) -> None:
        chunks = self.client.pull_global(self.site_id, self._want)
        assembler = self._assembler()
        for c in chunks:
            assembler.add(c)
        self.global_params = HostMirror.keep(assembler.finish(), self._on_device)
        self.bytes_down += assembler.payload_bytes
        self.round = chunks[0].round if chunks else 0
        self._load_global_into_model()
        if self.round > 0 and self._want is None:
            self.round_hashes[self.round - 1] = params_sha256(self.global_params)

    def _load_global_into_model(self) -> None:
        HostMirror.load({n: h.tensor for n, h in self.layout.held().items()}, self.global_params)
        self.layout.after_pull()

    def sync(self, *, tokens: int, train_loss: float, inner_steps: int) -> str:
        """Ends this site's round: pushes Δ = θ − θ^s, waits for the commit, applies u.

        Blocks until the round is committed. Returns the hash of this rank's global θ.
        If the round was committed without this push (it came too late), or the site was
        evicted (its lease ran out), the site drops this round's work, pulls θ whole (joining
        again if it must) and goes on from the open round. The ranks of a sharded site each
        push their own slices as one part of the site's push, and agree on the outcome.
        """
        r = self.round
        t0 = time.perf_counter()
        held = self.layout.held()
        pushed = {n: h for n, h in held.items() if h.push}
        local = self._host.host({n: h.tensor for n, h in pushed.items()})
        delta = pseudo_gradient({n: self.global_params[n] for n in pushed}, local)
        if self._residual is not None:
            delta = with_residual(delta, self._residual, self.error_feedback_decay)
        t1 = time.perf_counter()
        boxes = {n: (h.box, self._specs[n].shape) for n, h in pushed.items()}
        chunks = list(encode_chunks(delta, codec=self.codec, round=r, chunk_bytes=self.chunk_bytes, boxes=boxes))
        residual = None
        if self.error_feedback:
            sent = ChunkAssembler(self._specs) if self._want is None else SliceAssembler(self._specs, {n: h.box for n, h in pushed.items()})
            for c in chunks:
                sent.add(c)
            decoded = sent.finish()
            residual = {n: delta[n] - decoded[n] for n in delta}
        parts = self.layout.world
        header = PushHeader(
            site_id=self.site_id, round=r, tokens=tokens, train_loss=train_loss, inner_steps=inner_steps, part=self.layout.rank, parts=parts,
            eval=self._eval if self.layout.leader else None,
        )  # fmt: skip
        if self.before_push is not None:
            self.before_push(r)
        t2 = time.perf_counter()
        self._times = {"round": r, "delta_s": t1 - t0, "encode_s": t2 - t1, "push_s": 0.0, "wait_s": 0.0, "pull_s": 0.0}
        outcome, why, update = self._exchange(r, header, chunks)
        outcome = self.layout.agree(outcome)  # every rank of the site goes the same way
        self._eval = None  # sent (or, if the push did not count, a stale evaluation: dropped)
        if not outcome & DROPPED:
            self._residual = residual  # only a push that counted moves the residual on
        if outcome:
            return self._catch_up(r, why, outcome)
        assert update is not None
        t3 = time.perf_counter()
        apply_update(self.global_params, update.finish())
        self.bytes_down += update.payload_bytes
        self._load_global_into_model()
        self._times["apply_s"] = time.perf_counter() - t3  # decoding happened as the chunks arrived (pull_s)
        self.timings.append(self._times)
        self.round = r + 1
        digest = params_sha256(self.global_params)
        if self._want is None:
            self.round_hashes[r] = digest
        return digest

    def _exchange(self, r: int, header: PushHeader, chunks: list) -> tuple[int, RemoteError | None, ChunkAssembler | SliceAssembler | None]:
        """Push, wait, pull. Returns the outcome flags (0 with the pulled update, or what
        catching up needs), and the error behind them."""
        backoff = _Backoff(self.reconnect_timeout_s)
        while True:
            # When the coordinator cannot be reached (it restarted, or the network failed),
            # back off and start again from the push: pushes are idempotent (a repeat of a
            # counted push is answered "duplicate"), and a coordinator that restarted from its
            # checkpoint has lost the pushes of its open round.
            stage = "push"
            try:
                t = time.perf_counter()
                result = self.client.push(header, iter(chunks))
                self._times["push_s"] += time.perf_counter() - t
                self.bytes_up += result.payload_bytes
                if result.merged_into:
                    # Late, but merged into the open round (quorum.late=merge): it counted; go on
                    # from the open round's θ like a site whose push was dropped.
                    self._log(f"site {self.site_id}: round {r} push came late; merged into round {result.merged_into}")
                    return MERGED | CATCH_UP, None, None
                stage = "pull"
                t = time.perf_counter()
                self._wait_committed(r)
                self._times["wait_s"] += time.perf_counter() - t
                t = time.perf_counter()
                assembler = self._assembler()
                for c in self.client.pull_update(self.site_id, r, self._want):
                    assembler.add(c)
                self._times["pull_s"] += time.perf_counter() - t
                return 0, None, assembler
            except RemoteError as e:
                if e.code in RETRYABLE:
                    self.reconnects += 1
                    backoff.wait(e, self._log, f"site {self.site_id} round {r} {stage}")
                    continue
                rejoin = REJOIN if e.code == "FAILED_PRECONDITION" else 0
                if stage == "push" and e.code in ("ABORTED", "FAILED_PRECONDITION"):
                    return DROPPED | CATCH_UP | rejoin, e, None
                if stage == "pull" and e.code in ("FAILED_PRECONDITION", "NOT_FOUND"):
                    return CATCH_UP | rejoin, e, None
                raise

    def _catch_up(self, r: int, why: RemoteError | None, outcome: int) -> str:
        """Loads θ whole (this rank's slices of it), the site's leader joining again first when
        the coordinator asked for it. Round r's work did not count if ``outcome`` has DROPPED
        (else it counted, and only its update is gone, e.g. after a coordinator restart)."""
        if outcome & MERGED:
            self.merged_rounds.append(r)
        if outcome & DROPPED:
            self.dropped_rounds.append(r)
        if why is not None:
            self._log(f"site {self.site_id}: {why.message}" + ("; joining again" if outcome & REJOIN else ""))
        if outcome & REJOIN:
            self.rejoins += 1
            if self.layout.leader:
                self._call(self._join, "join")
            self.layout.barrier()
        self._call(self._pull_global, "pull of θ")
        return params_sha256(self.global_params)

    def _call(self, fn: Callable[[], object], what: str) -> object:
        """fn(), retried with backoff while the coordinator cannot be reached."""
        backoff = _Backoff(self.reconnect_timeout_s)
        while True:
            try:
                return fn()
            except RemoteError as e:
                if e.code not in RETRYABLE:
                    raise
                self.reconnects += 1
                backoff.wait(e, self._log, f"site {self.site_id} {what}")

    def _wait_committed(self, r: int) -> None:
        deadline = time.monotonic() + self.round_timeout_s
        while True:
            status = self.client.wait_round(self.site_id, r, max(0.0, min(self.wait_poll_s, deadline - time.monotonic())))
            if status.committed_rounds > r:
                return
            if time.monotonic() >= deadline:
                raise RemoteError("ROUND_TIMEOUT", f"round {r} was not committed within {self.round_timeout_s:.0f}s")
            self._log(f"site {self.site_id}: waiting for round {r} to close")

    def global_sha256(self) -> str:
        return params_sha256(self.global_params)

    def leave(self, global_sha256: str | None = None) -> None:
        """Says goodbye for the site (its leader rank), reporting the hash of its whole θ."""
        self.close()
        digest = global_sha256 or self.global_sha256()
        self._call(lambda: self.client.leave(self.site_id, digest, self._eval), "leave")

