"""The coordinator's data plane cut into ``coordinator.shards`` ranges of whole tensors.

Each range is a Shard (shard.py) with its own θ, outer optimizer, downlink residual and sum of
the round's pushes. A counted push is added into every shard's sum at once, a thread each
(the compiled loops release the GIL), and a round is committed by ``commit_shards``
(commit.py): every shard measures its part on its own thread, the checks are made once on the
whole model's figures, then every shard writes. θ, its hash, the update's chunks and the
records are those of one shard holding every parameter, bit for bit
(tests/unit/test_sharded_commit.py), so the cut changes how many cores a round uses and
nothing a site sees. This is the cut that shard processes will each serve (docs/design.md).

It offers the rest of the coordinator what one Shard did (``ready``, ``specs``, ``split``,
``hash``, ``open``, ``add``, ``commit``, ``checkpoint``, ``restore``...), over the whole model,
and the spike guard, which judges the whole model's mean Δ. Takes no lock: the coordinator
holds its lock around every call.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from diloco.coordinator import kernels
from diloco.coordinator.commit import Closing, RoundRecord, commit_shards
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.guard import SpikeGuard
from diloco.coordinator.ranges import split_ranges
from diloco.coordinator.shard import Shard, fragment_problem
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig, OuterOptimizer, params_sha256
from diloco.outer.fragments import fragment_of_round, split_fragments
from diloco.types import Chunk, TensorSpec
from diloco.wire.held import HeldPush

T = TypeVar("T")
X = TypeVar("X")


class ShardSet:
    def __init__(self, outer_cfg: OuterConfig, cfg: CoordinatorConfig) -> None:
        self.cfg, self.outer_cfg = cfg, outer_cfg
        self.parts: list[Shard] = [Shard(outer_cfg, cfg)]  # until θ₀ is installed: one, empty
        self.guard = SpikeGuard(cfg.guard)
        self.ready = False  # θ₀ is set (always, unless init=site and no site has sent it yet)
        self.init_from = "a site (init=site), not yet"  # who θ₀ came from, named in messages
        self.specs: dict[str, TensorSpec] = {}
        self.split: tuple[tuple[str, ...], ...] = ((),)
        self.hash = ""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ---- θ₀ ------------------------------------------------------------------------------
    def install(self, params: Mapping[str, torch.Tensor], source: str) -> None:
        """θ₀ cut into the ranges. ValueError: more fragments than the model has layers, more
        shards than it has tensors, or shards without the compiled loops (the cut's exactness
        rests on their norms)."""
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        split = split_fragments(shapes, self.cfg.fragments, self.cfg.fragment_split)
        ranges = split_ranges(shapes, self.cfg.shards)
        if len(ranges) > 1 and kernels.native is None:
            raise ValueError(
                f"coordinator.shards={self.cfg.shards}: the cut needs the compiled loops (diloco/codec/_int8_native.c: "
                "pip install -e . with a C compiler), whose norms add the shards' parts exactly; set coordinator.shards=1"
            )
        parts = []
        for names in ranges:
            part = Shard(self.outer_cfg, self.cfg)
            part.install({n: params[n] for n in names}, source, split=split)
            parts.append(part)
        self.parts, self.split = parts, split
        self.specs = {n: spec for part in parts for n, spec in part.specs.items()}
        self.hash = params_sha256(self.params)
        self.init_from, self.ready = source, True
        if self._pool is None and len(parts) > 1:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="coordinator-shard")

    # ---- what the coordinator reads ----------------------------------------------------------
    @property
    def params(self) -> dict[str, torch.Tensor]:
        """θ, every shard's tensors (references: read them under the coordinator's lock)."""
        return {n: p for part in self.parts if part.outer is not None for n, p in part.outer.params.items()}

    @property
    def outer(self) -> OuterOptimizer | _Whole | None:
        """The outer optimizer (one shard), or a view of the shards' as one (θ, its settings,
        the momentum buffers); None before θ₀."""
        if not self.ready:
            return None
        if len(self.parts) == 1:
            return self.parts[0].outer
        return _Whole(self)

    def round_specs(self, round: int) -> dict[str, TensorSpec]:
        """The tensors a push for ``round`` carries: every one, or its fragment's."""
        return {n: self.specs[n] for n in self.split[fragment_of_round(round, self.cfg.fragments)]}

    def check_fragment(self, round: int, name: str) -> None:
        why = fragment_problem(self.split, self.cfg.fragments, round, name)
        if why is not None:
            raise CoordinatorError("invalid_argument", why)

    # ---- the open round ----------------------------------------------------------------------
    def open(self, number: int) -> tuple[tuple[str, ...], int]:
        """A fresh sum for round ``number`` in every shard; the names it syncs and its fragment."""
        opened = [part.open(number) for part in self.parts]
        return tuple(sorted(n for names, _ in opened for n in names)), fragment_of_round(number, self.cfg.fragments)

    def add(self, delta: Mapping[str, torch.Tensor] | HeldPush, weight: float, scale: float | None = None) -> None:
        """A counted push's Δ into every shard's sum (its own tensors), the shards at once."""
        if scale is not None and not isinstance(delta, HeldPush):
            for t in delta.values():
                t.mul_(scale)
        if isinstance(delta, HeldPush):
            self.each(lambda part: part.add(delta, weight), self.parts)
        else:
            self.each(lambda part: part.add({n: delta[n] for n in part.names}, weight), self.parts)

    def add_zero(self, weight: float) -> None:
        for part in self.parts:
            part.add_zero(weight)

    def commit(self, state: Any, closing: Closing, times: dict[str, Any]) -> tuple[RoundRecord, list[Chunk]]:
        """The open round's outer step over every shard (commit.commit_shards)."""
        steps = [part.step(state.number, lane=i) for i, part in enumerate(self.parts)]
        return commit_shards(state, steps, self.guard, closing, times, self.each)

    def each(self, fn: Callable[[X], T], items: list[X]) -> list[T]:
        """``fn`` of every item, on the shards' threads when there are several; in order."""
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """By reference, θ included (the round stays closing until its checkpoint is on disk).
        One shard: its state as it always was; several: θ whole (its hash is checked on
        restore) and each shard's optimizer state and residual."""
        if len(self.parts) == 1:
            return {**self.parts[0].checkpoint(), "guard_history": self.guard.history}
        parts = [part.checkpoint() for part in self.parts]
        return {
            "outer": {"params": self.params},
            "shards": [{"optimizer": p["outer"]["optimizer"], "names": sorted(p["outer"]["params"]), "down_residual": p["down_residual"]} for p in parts],
            "guard_history": self.guard.history,
            "init_from": self.init_from,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """θ, the optimizer states, the residuals and the guard's history from a checkpoint
        (θ₀ installed from it when there is none: init=site). ValueError: a checkpoint of
        another cut (restart with the coordinator.shards it was written with)."""
        if not self.ready:
            self.install(state["outer"]["params"], str(state.get("init_from", "the checkpoint")))
        saved = state.get("shards")
        count = 1 if saved is None else len(saved)
        if count != len(self.parts) or (saved is not None and [s["names"] for s in saved] != [sorted(p.specs) for p in self.parts]):
            raise ValueError(f"the checkpoint was written by a coordinator cut into {count} shards; this one has coordinator.shards={self.cfg.shards}")
        if saved is None:
            self.parts[0].restore(state)
        else:
            params = state["outer"]["params"]
            for part, s in zip(self.parts, saved, strict=True):
                names = s["names"]
                part.restore({"outer": {"params": {n: params[n] for n in names}, "optimizer": s["optimizer"]}, "down_residual": s["down_residual"]})
        self.hash = params_sha256(self.params)
        self.guard = SpikeGuard(self.cfg.guard, list(state.get("guard_history", [])))


class _Whole:
    """The shards' outer optimizers seen as one, for the pulls of θ and of the momentum."""

    def __init__(self, shards: ShardSet) -> None:
        self._shards = shards
        first = shards.parts[0].outer
        assert first is not None
        self.cfg = first.cfg
        self.params = shards.params

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self._shards.parts:
            assert part.outer is not None
            out.update(part.outer.momentum_buffers())
        return dict(sorted(out.items()))
