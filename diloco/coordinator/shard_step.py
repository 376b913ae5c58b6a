"""One shard's part of a round's commit, in steps that write nothing until told to.

A coordinator's parameters may be cut into ranges (shards), each with its own θ, outer
optimizer, downlink residual and sum of the round's pushes. Whether a round moves θ is decided
on whole-model figures (the mean Δ's norm for the guard, the proposed and sent updates' norms
against |θ| for check_update), so each shard gives the parts of those figures (every tensor's
sum of squares, diloco.coordinator.kernels.squares) and the one that decides adds them in name
order (diloco.coordinator.commit.commit_shards): the same float64 for any cut. Only then does
a shard write, or put back what it had tried.

Two ways through, as for one shard (diloco.coordinator.commit): block by block in place
(diloco.coordinator.commit_blocks: ``check``, then ``apply``) where that applies, else the
generic step (``mean``, ``propose``, ``settle``), each the same bits as the other.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diloco.coordinator import commit_blocks, kernels
from diloco.outer import OuterStepRefused, StackedAggregate, WeightedMean
from diloco.outer.optimizer import OuterOptimizer, Tentative
from diloco.outer.pseudo_gradient import tensor_header, tensor_sha256
from diloco.types import Chunk

if TYPE_CHECKING:
    from diloco.coordinator.commit import UpdateEncoder


@dataclass
class Proposal:
    """A generic step proposed by one shard: the squares of its proposed update u and of u as
    sent (ũ; None where the downlink sends u itself), and what failed while encoding it."""

    u_sq: dict[str, float]
    sent_sq: dict[str, float] | None
    failed: str | None
    encode_s: float  # the downlink's encoding (and decoding) of it


class ShardStep:
    """One shard's round: ``names`` the tensors of its own that the round syncs (none when the
    round's fragment has none of them), ``acc`` their sum of the round's pushes, ``outer`` and
    ``encoder`` its θ, optimizer and downlink."""

    def __init__(
        self, names: Iterable[str], acc: WeightedMean | StackedAggregate, outer: OuterOptimizer, encoder: UpdateEncoder, round: int, lane: int = 0
    ) -> None:
        """``lane``: which hashing thread its blockwise pass uses (the shard's index)."""
        self.acc, self.outer, self.encoder, self.round, self.lane = acc, outer, encoder, round, lane
        self.names = sorted(names)
        self.blocks = commit_blocks.plan(acc, outer, encoder, round) if self.names else None
        self.chunks: list[Chunk] = []
        self.digests: dict[str, tuple[bytes, bytes]] | None = None  # each tensor's (header, sha256) once written
        self.sent_sq: dict[str, float] = {}
        self._mean: dict[str, torch.Tensor] | None = None
        self._tentative: Tentative | None = None
        self._residual: dict[str, torch.Tensor] | None = None

    # ---- measuring (writes nothing) ------------------------------------------------------
    def check_blocks(self) -> dict[str, float]:
        """The blockwise path's pass 1: the mean Δ's squares (its update's and bound's stay on
        ``blocks``)."""
        assert self.blocks is not None
        self.blocks.check()
        return dict(self.blocks.g_sq)

    def mean(self) -> dict[str, float] | str:
        """The generic path: the mean Δ's squares, or why there is no mean."""
        try:
            self._mean = self.acc.mean()
        except (ValueError, RuntimeError) as e:
            return f"no mean Δ: {e}"
        return kernels.squares(self._mean)

    def theta_sq(self) -> dict[str, float]:
        """|θ|² of the tensors this round steps, each (check_update's limit)."""
        return kernels.squares({n: self.outer.params[n] for n in self.names})

    # ---- the blockwise path ----------------------------------------------------------------
    def apply_blocks(self, times: dict[str, float]) -> None:
        """Pass 2, once every shard's pass 1 passed the checks: writes θ, the momentum and
        the residual; its chunks, digests and the update's squares are kept."""
        assert self.blocks is not None
        self.blocks.apply(self.chunks.extend, times, self.lane)
        self.digests, self.sent_sq = self.blocks.digests, self.blocks.sent_sq

    # ---- the generic path ------------------------------------------------------------------
    def propose(self) -> Proposal:
        """The optimizer's step tried (θ and its state held until ``settle``) and its update
        encoded for the downlink; what the generic step would refuse is reported, not raised."""
        if self._mean is None:
            got = self.mean()
            assert not isinstance(got, str), got
        assert self._mean is not None
        feedback = self.encoder.feedback
        self._residual = feedback.residual if feedback is not None else None
        tentative = self._tentative = self.outer.propose(self._mean, round=self.round)
        u_sq = kernels.squares(tentative.proposed)
        failed = None
        sent = tentative.proposed
        lists: list[list[Chunk]] = []
        t0 = time.perf_counter()
        try:
            sent = self.encoder.transmit(tentative.proposed, lists.append)
        except OuterStepRefused as e:
            failed = str(e)
        except Exception as e:  # noqa: BLE001 - the step refuses it, as OuterOptimizer.step does
            failed = f"the outer step failed: {type(e).__name__}: {e}"
        tentative.sent = sent
        self.chunks = lists[0] if lists else []
        return Proposal(u_sq, None if sent is tentative.proposed else kernels.squares(sent), failed, time.perf_counter() - t0)

    def settle(self, accept: bool, size: float) -> None:
        """Writes the proposed step (θ := θ + ũ) or puts back θ, the optimizer state and the
        downlink residual as they were."""
        assert self._tentative is not None
        self.outer.settle(self._tentative, accept, size)
        if not accept:
            self.chunks = []
            if self.encoder.feedback is not None:
                self.encoder.feedback.residual = self._residual  # exactly as it was (carry would merge)

    # ---- after it ----------------------------------------------------------------------------
    def zeros(self) -> None:
        """The round moved nothing: its sites get a zero update of this shard's tensors."""
        self.chunks = self.encoder.encode_zeros(self.names) if self.names else []

    def theta_digests(self) -> dict[str, tuple[bytes, bytes]]:
        """Each of this shard's tensors' (header, sha256), as θ is now."""
        if self.digests is None:
            self.digests = {n: (tensor_header(n, p), tensor_sha256(p)) for n, p in self.outer.params.items()}
        return self.digests
