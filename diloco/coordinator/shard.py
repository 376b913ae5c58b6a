"""The coordinator's data plane for the parameters it owns: θ and the outer optimizer, the
split into fragments, the open round's sum of pseudo-gradients, the spike guard that judges
its mean, and the downlink's encoding of each update.

Today one shard owns every parameter. It is the part that the next step cuts by parameter
range (docs/design.md, "The coordinator"): S shards, each receiving, summing, stepping and
encoding its own range, all committing the participant set the control plane
(diloco.coordinator.round_book, sessions) decided. It knows nothing of sites, leases or round
numbers beyond the one it is told to open, and takes no lock: the coordinator holds its lock
around every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from diloco.coordinator import kernels
from diloco.coordinator.commit import Closing, RoundRecord, UpdateEncoder, commit
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.guard import SpikeGuard
from diloco.coordinator.shard_step import ShardStep
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, OuterOptimizer, StackedAggregate, WeightedMean, averaged_from, make_aggregate, params_sha256
from diloco.outer.fragments import fragment_of_round, split_fragments
from diloco.security.ids import quote
from diloco.types import Chunk, TensorSpec
from diloco.wire import fingerprint
from diloco.wire.held import HeldPush


class Shard:
    def __init__(self, outer_cfg: OuterConfig, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.outer_cfg = outer_cfg
        self.ready = False  # θ₀ is set (always, unless init=site and no site has sent it yet)
        self.init_from = "a site (init=site), not yet"  # who θ₀ came from, named in messages
        self.specs: dict[str, TensorSpec] = {}
        self.shapes: dict[str, torch.Size] = {}
        self.split: tuple[tuple[str, ...], ...] = ((),)
        self.hash = ""
        self.guard = SpikeGuard(cfg.guard)
        self.outer: OuterOptimizer | None = None
        self.encoder: UpdateEncoder | None = None
        self.acc: WeightedMean | StackedAggregate = make_aggregate({}, cfg.aggregate, cfg.robust.trim)  # the open round's sum
        self.names: tuple[str, ...] = ()  # the open round's tensors (sorted)

    def install(self, params: Mapping[str, torch.Tensor], source: str, split: tuple[tuple[str, ...], ...] | None = None) -> None:
        """θ₀ and everything sized by it: the outer optimizer, the split, the encoder.
        ValueError: more fragments than the model has layers. ``split``: the whole model's
        fragments, for a shard that holds a range of it (``params``); its rounds sync the
        names of each fragment that it holds."""
        cfg = self.cfg
        average_from = averaged_from(cfg.total_rounds, cfg.flush_rounds, self.outer_cfg.final_average, last=cfg.fragments if cfg.frozen_end else 1)
        outer = OuterOptimizer(
            params, self.outer_cfg, steps=-(-cfg.total_rounds // cfg.fragments), fragments=cfg.fragments, average_from=average_from, norm=kernels.norm
        )
        kernels.available()  # checked once per process, here rather than in the first commit
        specs = fingerprint(outer.params)
        if split is None:
            split = split_fragments({n: p.shape for n, p in outer.params.items()}, cfg.fragments, cfg.fragment_split)
        self.split = tuple(tuple(n for n in part if n in outer.params) for part in split)
        self.outer, self.specs = outer, specs
        self.shapes = {n: p.shape for n, p in outer.params.items()}
        self.encoder = UpdateEncoder.of(cfg.codec_down.build(), specs, cfg.chunk_bytes, cfg.error_feedback_down)
        self.hash = params_sha256(outer.params)
        self.init_from = source
        self.ready = True

    # ---- the open round ----------------------------------------------------------------
    def open(self, number: int) -> tuple[tuple[str, ...], int]:
        """A fresh sum for round ``number``; returns the names it syncs and its fragment."""
        fragment = fragment_of_round(number, self.cfg.fragments)
        names = self.split[fragment] if len(self.split) > fragment else ()  # before θ₀ (init=site): none
        # The previous round's sums are done with (its commit took their mean): reused.
        self.acc = make_aggregate({n: self.shapes[n] for n in names}, self.cfg.aggregate, self.cfg.robust.trim, reuse=self.acc)
        self.names = tuple(sorted(names))
        return self.names, fragment

    def add(self, delta: Mapping[str, torch.Tensor] | HeldPush, weight: float, scale: float | None = None) -> None:
        """A counted push's Δ (``scale``: clipped down by it first, in place), as float32 values
        or as the payloads it came in (the fused intake: Intake.fused)."""
        if isinstance(delta, HeldPush):
            assert scale is None and isinstance(self.acc, WeightedMean), "a held push is only taken where it is added as it came"
            self.acc.add_with(delta.accumulate_into, weight)
            return
        if scale is not None:
            for t in delta.values():
                t.mul_(scale)
        self.acc.add(delta, weight)

    def add_zero(self, weight: float) -> None:
        """A withheld site's zero Δ with its weight (quorum.withheld=zero; weighted means only)."""
        if isinstance(self.acc, WeightedMean):
            self.acc.add_zero(weight)

    def round_specs(self, round: int) -> dict[str, TensorSpec]:
        """The tensors a push for ``round`` carries: every one, or its fragment's."""
        return {n: self.specs[n] for n in self.split[fragment_of_round(round, self.cfg.fragments)]}

    def check_fragment(self, round: int, name: str) -> None:
        """A chunk of a tensor that round ``round``'s fragment does not hold is refused, saying
        which fragment it belongs to (an unknown name is left to the assembler to name)."""
        why = fragment_problem(self.split, self.cfg.fragments, round, name)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)

    def step(self, round: int, lane: int = 0) -> ShardStep:
        """Its part of the open round's commit, for a coordinator cut by range (commit_shards;
        ``lane``: its index there)."""
        assert self.outer is not None and self.encoder is not None
        return ShardStep(self.names, self.acc, self.outer, self.encoder, round, lane)

    def commit(self, state: Any, closing: Closing, times: dict[str, Any]) -> tuple[RoundRecord, list[Chunk]]:
        """The open round's outer step (diloco.coordinator.commit: total); θ's hash moves with it."""
        assert self.outer is not None and self.encoder is not None
        return commit(state, self.acc, self.outer, self.guard, self.encoder, closing, times)

    # ---- what a checkpoint holds of it -------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """By reference, θ included: no commit can move it before it is written (the round
        stays closing until its checkpoint is on disk: Coordinator._publish)."""
        assert self.outer is not None and self.encoder is not None
        return {
            "outer": self.outer.state_dict(clone=False),
            "down_residual": self.encoder.feedback.residual if self.encoder.feedback is not None else None,
            "guard_history": self.guard.history,
            "init_from": self.init_from,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """θ, the outer optimizer, the downlink residual and the guard's history from a checkpoint
        (θ₀ installed from it when this shard has none: init=site)."""
        if not self.ready:
            self.install(state["outer"]["params"], str(state.get("init_from", "the checkpoint")))
        assert self.outer is not None and self.encoder is not None
        self.outer.load_state_dict(state["outer"])
        self.hash = params_sha256(self.outer.params)
        if self.encoder.feedback is not None:
            self.encoder.feedback.carry(state["down_residual"])
        self.guard = SpikeGuard(self.cfg.guard, list(state.get("guard_history", [])))


def fragment_problem(split: tuple[tuple[str, ...], ...], fragments: int, round: int, name: str) -> str | None:
    """Why a push for ``round`` may not carry tensor ``name`` (another fragment's), or None."""
    if fragments == 1:
        return None
    fragment = fragment_of_round(round, fragments)
    if name in split[fragment]:
        return None
    owner = next((i for i, part in enumerate(split) if name in part), None)
    if owner is None:
        return None
    return f"push for round {round} carries {quote(name, 80)}, of fragment {owner}; round {round} syncs fragment {fragment} of {fragments}"
