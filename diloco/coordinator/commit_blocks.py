"""The blockwise in-place commit: a round's outer step, its downlink encoding and θ's hash,
block by block, with scratch buffers of one block instead of the generic path's full-size
temporaries (the float32 mean, θ's and the momentum's copies, the gradient, the proposed,
compensated and decoded updates, the new residual).

It takes the common round: the mean of a WeightedMean (``aggregate=mean``), torch's SGD with
Nesterov momentum and nothing more (OuterOptimizer.nesterov_step), or an averaging round of
any optimizer (θ − mean Δ: streaming's flush rounds, final_average's last round);
a lossless downlink (fp32, fp32+zstd) or a blockwise-scaled one (int8, int4, e3m0, each also
+zstd); the compiled loops present and agreeing with
torch on this machine (diloco.coordinator.kernels.available); the outer optimizer measuring
with the coordinator's norm (kernels.norm). For it, every value is the generic path's, bit
for bit: θ and its hash, the momentum, the downlink residual, the chunks' bytes, the norms
(tests/unit/test_commit_blocks.py). For any other round ``plan`` says None and the generic
path (OuterOptimizer.step, UpdateEncoder.transmit) runs as it always did.

A block is a chunk of the downlink (``codec.max_chunk_numel(chunk_bytes)`` elements from a
tensor's start, of any size: the compiled loops compute each element alone, so no result
depends on where a block starts or ends): the chunks made block by block are encode_chunks'.
All or nothing, in two passes over the round's tensors:

1. ``check`` writes nothing. It measures the mean Δ (the guard's norm; finite exactly when
   every value is) and the proposed update u (check_update's norm), and, for a lossy
   downlink, whether x = u + β·residual is finite and a bound on the decoded update ũ. Then
   ``sure`` runs check_update on u as the generic step does (OuterStepRefused: nothing was
   written), and decides the check of the update as sent without encoding: a blockwise-scaled
   codec never decodes a value past its block's absmax, so |ũ|² <= Σ_blocks n_b · absmax_b(x)²;
   within check_update's limit, with a margin for float64 rounding, that check cannot fail
   (nor can ũ be non-finite where x is finite). Where x is not finite (the encoder would
   refuse it) or the bound is not within the limit, ``sure`` says no and the generic path
   takes the round: nothing was written, so it computes exactly what it always did. (The
   alternative, encoding and decoding in the first pass, would cost a third pass's work in
   every round for a case that needs an update ~100x θ.)
2. ``apply`` writes, block by block: the momentum, x (scratch), its chunk, ũ as every site
   decodes it (scratch), the residual x − ũ and θ + ũ, in place, while a worker thread
   hashes θ's blocks as they are done (each tensor's SHA-256, combined as params_sha256 does).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from diloco.codec import get_codec, is_lossless
from diloco.codec.blockwise import absmax_bounded_block
from diloco.coordinator import kernels
from diloco.outer import OuterOptimizer, WeightedMean, check_update
from diloco.outer.optimizer import ABSURD_UPDATE_RATIO, NesterovStep
from diloco.outer.pseudo_gradient import combine_sha256, tensor_header
from diloco.types import Chunk
from diloco.wire.chunks import chunk_ranges, dtype_name

if TYPE_CHECKING:
    from diloco.coordinator.commit import UpdateEncoder

ENABLED = True  # False: every round takes the generic path (benchmarks and tests compare the two)

# The bound on |ũ| is computed, and |ũ| is measured, in float64 with rounding: a relative
# margin far above either error (a few units in the last place per addition, ~1e-16 each).
_BOUND_MARGIN = 1e-6


@dataclass
class _Tensor:
    """One stepped tensor's flat views: θ, the float64 sum, its momentum and residual."""

    theta: torch.Tensor
    sums: torch.Tensor
    mode: int  # 0: no momentum this round; 1: no buffer yet (torch starts it as the gradient); 2: a buffer; 3: an averaging round (u = −g)
    momentum: torch.Tensor | None
    residual: torch.Tensor | None  # the residual read into x (None: none yet, or no error feedback)


class BlockCommit:
    """One round on the blockwise path: ``check`` (pass 1), ``sure``, ``apply`` (pass 2)."""

    def __init__(self, outer: OuterOptimizer, encoder: UpdateEncoder, sums: Mapping[str, torch.Tensor], weight: float, step: NesterovStep, round: int) -> None:
        self.outer, self.encoder, self.weight, self.step, self.round = outer, encoder, weight, step, round
        self.order = list(sums)  # the mean's order: its norm adds the tensors in it
        self.stepped = sorted(sums)  # the step's (and the update's) order
        codec = encoder.codec
        self.lossless = is_lossless(codec.name)
        self.block = codec.max_chunk_numel(encoder.chunk_bytes)
        self.codec_block = 0 if self.lossless else int(absmax_bounded_block(codec) or 0)
        feedback = None if self.lossless else encoder.feedback
        self.feedback = feedback
        self.beta = feedback.decay if feedback is not None else 1.0
        residual = feedback.residual if feedback is not None and feedback.residual is not None else {}
        mode = 3 if step.averaging else 0 if step.momentum == 0 else None
        self.tensors = {
            n: _Tensor(
                theta=outer.params[n].view(-1),
                sums=sums[n].view(-1),
                mode=mode if mode is not None else (1 if step.buffers[n] is None else 2),
                momentum=None if step.buffers[n] is None or mode == 0 else step.buffers[n].view(-1),
                residual=residual[n].view(-1) if n in residual else None,
            )
            for n in self.stepped
        }
        self.delta_norm = math.nan
        self.proposed_norm = math.nan
        self._bound_sq = math.inf
        self._x_finite = False

    # ---- pass 1 --------------------------------------------------------------------------
    def check(self) -> float:
        """Pass 1 (writes nothing): returns the mean Δ's norm, as ``norm(acc.mean())``. Each
        tensor's parts stay in ``g_sq``, ``u_sq`` and ``bound_sq`` (a coordinator cut by
        parameter range adds its shards' parts in name order: diloco.coordinator.rounds)."""
        self.g_sq, self.u_sq, self.bound_sq = {}, {}, {}
        finite = True
        for n, t in self.tensors.items():
            lanes_g, lanes_u, stats = kernels.lanes(), kernels.lanes(), np.zeros(2, dtype=np.float64)
            self._pass(t, 0, t.theta.numel(), write=False, x=None, lanes_g=lanes_g, lanes_u=lanes_u, stats=stats)
            self.g_sq[n], self.u_sq[n] = kernels.native.lanes_sum(lanes_g), kernels.native.lanes_sum(lanes_u)
            self.bound_sq[n], finite = float(stats[0]), finite and not stats[1]
        self.delta_norm = kernels.root(self.g_sq[n] for n in self.order)
        self.proposed_norm = kernels.root(self.u_sq[n] for n in self.stepped)
        self._bound_sq, self._x_finite = total(self.bound_sq[n] for n in self.stepped), finite
        return self.delta_norm

    @property
    def x_finite(self) -> bool:
        """x = u + β·residual is finite everywhere (pass 1 measured it)."""
        return self._x_finite

    def sure(self) -> bool:
        """check_update of the proposed update, as the generic step runs it (raises
        OuterStepRefused; nothing is written); then True when the update as sent passes its
        check for certain, False when the generic path must decide (it takes the round)."""
        before = {n: self.outer.params[n] for n in self.stepped}
        check_update("proposed update", {}, before, size=self.proposed_norm, norm=self.outer.norm)
        return sure_of(self.lossless, self.codec_block, self._x_finite, self._bound_sq, lambda: self.outer.norm(before))

    # ---- pass 2 --------------------------------------------------------------------------
    def apply(self, sink: Callable[[list[Chunk]], None], times: dict[str, float], lane: int = 0) -> str:
        """Pass 2: writes the momentum, the residual and θ, hands the chunks to ``sink`` and
        returns θ's SHA-256 (params_sha256's; each tensor's parts stay in ``digests``, the
        update's squares in ``sent_sq``). Only after ``sure`` said True."""
        codec = self.encoder.codec
        decoder = get_codec(codec.name)  # as the sites decode it: the default instance of the name
        decode_into = getattr(decoder, "decode_into", None)
        longest = max((min(self.block, t.theta.numel()) for t in self.tensors.values()), default=0)
        x = torch.empty(longest, dtype=torch.float32)
        sent = x if self.lossless else torch.empty(longest, dtype=torch.float32)
        buffers: dict[str, torch.Tensor] = {}
        residuals: dict[str, torch.Tensor] = {}
        sent_sq: dict[str, float] = {}
        chunks: list[Chunk] = []
        encode_s = 0.0
        digest = _Digest(lane)
        try:
            for name in self.outer.names:
                param = self.outer.params[name]
                digest.tensor(name, tensor_header(name, param))
                t = self.tensors.get(name)
                if t is None:  # not stepped this round (another fragment's): hashed as it is
                    digest.update(param.view(-1).numpy())
                    continue
                if t.mode == 1:  # torch's first step starts the buffer as the gradient: written by the pass
                    buffers[name] = torch.empty_like(param)
                    t.momentum = buffers[name].view(-1)
                elif t.mode == 2:  # the buffer itself (written in place), as torch's state holds it
                    buf = self.step.buffers[name]
                    assert buf is not None
                    buffers[name] = buf
                out = None
                if self.feedback is not None:
                    out = t.residual if t.residual is not None else torch.empty(param.numel(), dtype=torch.float32)
                    residuals[name] = out.view(param.shape)
                lanes = None if self.lossless else kernels.lanes()
                for offset, k in chunk_ranges(t.theta.numel(), self.block):
                    xk, sk = x[:k], sent[:k]
                    self._pass(t, offset, k, write=True, x=xk, lanes_g=None, lanes_u=None, stats=None)
                    te = time.perf_counter()
                    payload = codec.encode(xk)
                    if not self.lossless:
                        if decode_into is not None:
                            decode_into(payload, k, sk)
                        else:
                            sk.copy_(decoder.decode(payload, k))
                    encode_s += time.perf_counter() - te
                    theta = t.theta[offset : offset + k]
                    residual = None if out is None else out[offset : offset + k].numpy()
                    with _lanes_from(lanes, offset) as block_lanes:
                        kernels.native.outer_apply(xk.numpy(), sk.numpy(), theta.numpy(), residual, block_lanes)
                    chunks.append(
                        Chunk(name=name, shape=tuple(param.shape), dtype=dtype_name(param.dtype), offset=offset, numel=k, codec=codec.name, payload=payload)
                    )
                    digest.update(theta.numpy())
                if lanes is not None:
                    sent_sq[name] = kernels.native.lanes_sum(lanes)
        finally:
            self.digests = digest.parts()
            hexdigest = combine_sha256(self.digests)
        times["encode_s"] = encode_s
        self.sent_sq = dict(self.u_sq) if self.lossless else sent_sq
        size = self.proposed_norm if self.lossless else kernels.root(sent_sq[n] for n in self.stepped)
        self.outer.stepped(self.round, self.step, buffers, size)
        if self.feedback is not None:
            self.feedback.carry(residuals)
        sink(chunks)
        return hexdigest

    def _pass(
        self,
        t: _Tensor,
        offset: int,
        k: int,
        *,
        write: bool,
        x: torch.Tensor | None,
        lanes_g: np.ndarray | None,
        lanes_u: np.ndarray | None,
        stats: np.ndarray | None,
    ) -> None:
        """The compiled outer step over elements [offset, offset + k) of one tensor."""
        end = offset + k
        momentum = None if t.momentum is None else t.momentum[offset:end].numpy()
        residual = None if t.residual is None else t.residual[offset:end].numpy()
        kernels.native.outer_pass(
            t.sums[offset:end].numpy(),
            self.weight,
            momentum,
            t.mode,
            write and t.mode in (1, 2),
            self.step.momentum,
            -self.step.lr,
            t.theta[offset:end].numpy(),
            residual,
            self.beta,
            None if x is None else x.numpy(),
            lanes_g,
            lanes_u,
            self.codec_block if stats is not None else 0,
            stats,
        )


def plan(acc: object, outer: OuterOptimizer, encoder: UpdateEncoder, round: int) -> BlockCommit | None:
    """The round on the blockwise path, or None where it does not apply (the module's
    docstring: the generic path then takes it)."""
    if not (ENABLED and isinstance(acc, WeightedMean) and outer.norm is kernels.norm and kernels.available()):
        return None
    taken = acc.sums()
    if taken is None:
        return None
    sums, weight = taken
    codec = encoder.codec
    if not is_lossless(codec.name) and absmax_bounded_block(codec) is None:
        return None
    if not sums or any(n not in outer.params or not _fits(sums[n], outer.params[n], torch.float64) for n in sums):
        return None
    if not all(_fits(outer.params[n], outer.params[n], torch.float32) for n in sums):
        return None
    residual = encoder.feedback.residual if encoder.feedback is not None else None
    if residual is not None and not all(_fits(residual[n], outer.params[n], torch.float32) for n in sums if n in residual):
        return None
    step = outer.nesterov_step(list(sums), round)
    return None if step is None else BlockCommit(outer, encoder, sums, weight, step, round)


@contextlib.contextmanager
def _lanes_from(lanes: np.ndarray | None, offset: int) -> Iterator[np.ndarray | None]:
    """``lanes`` as a compiled loop that starts at element ``offset`` of the tensor takes them:
    it puts its i-th element in lane i % 16, the tensor's norm puts it in (offset + i) % 16,
    so the lanes go in rotated by offset % 16 and come back turned home (each lane still
    adds its elements in order)."""
    shift = offset % kernels.LANES
    if lanes is None or not shift:
        yield lanes
        return
    turned = np.roll(lanes, -shift)
    yield turned
    lanes[:] = np.roll(turned, shift)


def _fits(t: torch.Tensor, param: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous CPU tensor of ``dtype`` and ``param``'s shape."""
    return t.dtype == dtype and t.shape == param.shape and t.is_contiguous() and t.device.type == "cpu"


def total(values: Iterable[float]) -> float:
    """The values added in order (float64)."""
    out = 0.0
    for v in values:
        out += v
    return out


def sure_of(lossless: bool, codec_block: int, x_finite: bool, bound_sq: float, theta_norm: Callable[[], float]) -> bool:
    """True when the update as sent passes check_update for certain, the proposed one having
    passed (``BlockCommit.sure``; ``theta_norm``: |θ| of the stepped parameters, measured only
    where the bound needs it)."""
    if lossless:
        return True  # the update as sent is the proposed one: checked once, as the generic path does
    if not x_finite or not codec_block:
        return False
    bound = math.sqrt(bound_sq) * (1.0 + _BOUND_MARGIN)
    return bound <= ABSURD_UPDATE_RATIO or bound <= ABSURD_UPDATE_RATIO * max(theta_norm(), 1.0)


def _hash_worker(lane: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's hashing thread for ``lane`` (a commit's shard: shards committing at once
    hash on threads of their own; a forked child gets its own: the parent's is not there)."""
    return _hash_worker_of(os.getpid(), lane)


@functools.cache
def _hash_worker_of(pid: int, lane: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit-hash")


class _Digest:
    """params_sha256 of θ as it is written: each tensor's bytes fed to its own SHA-256 on one
    worker thread, in the order of ``update`` (hashlib releases the GIL on large buffers, the
    compiled loops too: a block is hashed while the next is computed), combined in name order
    at ``parts``. Buffers go to the worker in batches of about ``_BATCH`` bytes (a job per
    buffer cost more than the hashing itself for models of thousands of small tensors). A
    buffer must not change until ``parts``."""

    _BATCH = 1 << 22

    def __init__(self, lane: int = 0) -> None:
        self._lane = lane
        self._tensors: dict[str, tuple[bytes, hashlib._Hash]] = {}
        self._current: hashlib._Hash | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._batch: list[tuple[hashlib._Hash, bytes | np.ndarray]] = []
        self._bytes = 0

    def tensor(self, name: str, header: bytes) -> None:
        """The bytes of ``update`` from now on are tensor ``name``'s (``header``: tensor_header's)."""
        self._current = hashlib.sha256()
        self._tensors[name] = (header, self._current)

    def update(self, data: bytes | np.ndarray) -> None:
        assert self._current is not None, "update before tensor"
        n = data.nbytes if isinstance(data, np.ndarray) else len(data)
        if n:
            self._batch.append((self._current, data))
            self._bytes += n
            if self._bytes >= self._BATCH:
                self._flush()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch, self._bytes = self._batch, [], 0
            self._pending.append(_hash_worker(self._lane).submit(_feed, batch))

    def parts(self) -> dict[str, tuple[bytes, bytes]]:
        """Each tensor's header and digest (combine_sha256 makes params_sha256 of them)."""
        self._flush()
        for f in self._pending:
            f.result()
        return {name: (header, h.digest()) for name, (header, h) in self._tensors.items()}


def _feed(batch: list[tuple[hashlib._Hash, bytes | np.ndarray]]) -> None:
    for h, data in batch:
        h.update(data)
