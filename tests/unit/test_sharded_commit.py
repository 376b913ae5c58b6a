"""A round committed by a coordinator whose parameters are cut into ranges (commit_shards over
S shards, each with its own θ, outer optimizer, downlink residual and sum of the pushes) is the
round of one shard holding every parameter, bit for bit, for S = 2 and 3 on the same pushes:
θ and its hash, the momentum, the residual, the update's chunks, the norms and the records,
every round. Over fp32, int8 and topk2bit pushes; fp32, int8 and topk2bit downlinks; fragments
with a flush round (averaging: the generic path); a round the guard refuses, a mean that is not
finite and a step over the absurd-update limit (every shard keeps its state); a median of the
pushes. The coordinator's ShardSet: held pushes added by every shard on its own thread, its
checkpoint restored, and a checkpoint of another cut refused. And the ranges: whole tensors in
name order, balanced by elements."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from helpers import generator as _g

from diloco.codec import get_codec, make_codec
from diloco.coordinator import kernels
from diloco.coordinator.commit import Closing, RoundRecord, commit_shards
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.guard import GuardConfig, SpikeGuard
from diloco.coordinator.ranges import split_ranges
from diloco.coordinator.round_state import RoundState
from diloco.coordinator.shard import Shard
from diloco.coordinator.shards import ShardSet
from diloco.outer import OuterConfig, params_sha256
from diloco.types import Chunk, PushHeader
from diloco.wire import ChunkAssembler, encode_chunks, fingerprint
from diloco.wire.held import HeldPush

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(kernels.native is None, reason="the compiled loops are not built here (setup.py)")]

# Layers for fragments (blocks.0, blocks.1, blocks.2), odd sizes, an empty tensor.
SHAPES = {
    "blocks.0.w": (300_007,),
    "blocks.0.b": (37,),
    "blocks.1.w": (129, 517),
    "blocks.1.b": (1,),
    "blocks.1.e": (0,),
    "blocks.2.w": (70_001,),
    "head": (64,),
}
TOKENS = (100, 250, 77)


def _theta() -> dict[str, torch.Tensor]:
    g = _g(7)
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}


def _through(delta: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """Δ as the coordinator decodes it from a push in ``codec``."""
    specs = fingerprint(delta)
    assembler = ChunkAssembler(specs)
    for c in encode_chunks(delta, codec=make_codec(codec), chunk_bytes=1 << 16):
        assembler.add(c)
    return assembler.finish()


def _deltas(r: int, codec: str, scale: float = 1e-3) -> list[dict[str, torch.Tensor]]:
    g = _g(1000 + r)
    return [_through({n: torch.randn(s, generator=g) * scale * (1 + i) for n, s in SHAPES.items()}, codec) for i in range(len(TOKENS))]


def _shards(cfg: CoordinatorConfig, outer: OuterConfig, theta: Mapping[str, torch.Tensor], count: int) -> list[Shard]:
    whole = Shard(outer, cfg)
    whole.install(theta, "test")
    if count == 1:
        return [whole]
    shards = []
    for names in split_ranges(SHAPES, count):
        shard = Shard(outer, cfg)
        shard.install({n: theta[n] for n in names}, "test", split=whole.split)  # the whole model's fragments
        shards.append(shard)
    return shards


def _round(shards: list[Shard], guard: SpikeGuard, r: int, deltas: list[dict[str, torch.Tensor]]) -> tuple[RoundRecord, list[Chunk]]:
    opened = [shard.open(r) for shard in shards]
    state = RoundState.open(r, 0.0, tuple(n for names, _ in opened for n in names), opened[0][1])
    for i, (delta, tokens) in enumerate(zip(deltas, TOKENS, strict=True)):
        weight = state.take(PushHeader(site_id=f"s{i}", round=r, tokens=tokens, train_loss=1.0, inner_steps=1), 0.0, None)
        for shard in shards:
            shard.add({n: delta[n] for n in shard.names}, float(weight))
    return commit_shards(state, [shard.step(r) for shard in shards], guard, Closing(frozenset(), 0.0, 0.0, True))


def _state(shards: list[Shard]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"θ": {}, "momentum": {}, "residual": {}}
    for shard in shards:
        assert shard.outer is not None and shard.encoder is not None
        out["θ"].update(shard.outer.params)
        opt = shard.outer._opt  # noqa: SLF001 - the state the cuts must leave alike
        out["momentum"].update({n: opt.state[p]["momentum_buffer"] for n, p in shard.outer.params.items() if "momentum_buffer" in opt.state.get(p, {})})
        feedback = shard.encoder.feedback
        out["residual"].update(feedback.residual if feedback is not None and feedback.residual is not None else {})
    return out


def _same(a: Mapping[str, Mapping[str, torch.Tensor]], b: Mapping[str, Mapping[str, torch.Tensor]], what: str) -> None:
    for kind in a:
        assert sorted(a[kind]) == sorted(b[kind]), f"{what}: {kind}"
        for n in a[kind]:
            x, y = a[kind][n].contiguous(), b[kind][n].contiguous()
            assert x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32)), f"{what}: {kind} {n} differs"


def _wire(chunks: list[Chunk]) -> list[tuple[Any, ...]]:
    return [(c.name, c.shape, c.dtype, c.offset, c.numel, c.codec, bytes(c.payload)) for c in chunks]


CASES = {
    "int8-up-int8-down": ("int8", CoordinatorConfig(total_rounds=5, codec_down="int8", chunk_bytes=1 << 16), OuterConfig()),
    "fp32-up-fp32-down": ("fp32", CoordinatorConfig(total_rounds=4, codec_down="fp32", chunk_bytes=1 << 16), OuterConfig()),
    "topk2bit-up-topk2bit-down": ("topk2bit", CoordinatorConfig(total_rounds=4, codec_down="topk2bit", chunk_bytes=1 << 16), OuterConfig()),
    "fragments-and-flush": ("int8", CoordinatorConfig(total_rounds=7, codec_down="int8", fragments=2, flush_rounds=1, chunk_bytes=1 << 16), OuterConfig()),
    "guard": ("fp32", CoordinatorConfig(total_rounds=6, codec_down="int8", guard=GuardConfig(factor=3.0, window=3, min_rounds=2)), OuterConfig()),
    "median": ("int8", CoordinatorConfig(total_rounds=3, codec_down="fp32", aggregate="median"), OuterConfig()),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("count", [2, 3])
def test_a_cut_coordinator_commits_the_rounds_of_one_bit_for_bit(case: str, count: int) -> None:
    up, cfg, outer = CASES[case]
    theta = _theta()
    one, cut = _shards(cfg, outer, theta, 1), _shards(cfg, outer, theta, count)
    guards = SpikeGuard(cfg.guard), SpikeGuard(cfg.guard)
    spike = 3 if case == "guard" else None
    for r in range(cfg.total_rounds):
        deltas = _deltas(r, up)
        if r == spike:
            deltas = [{n: t * 100 for n, t in d.items()} for d in deltas]
        want, expected = _round(one, guards[0], r, deltas)
        got, sent = _round(cut, guards[1], r, deltas)
        assert got.summary() == want.summary(), f"round {r}"
        assert got.rejected == (r == spike), f"round {r}"
        assert _wire(sent) == _wire(expected), f"round {r}"
        assert got.global_sha256 == params_sha256(_state(cut)["θ"])
        _same(_state(cut), _state(one), f"round {r}")
        assert got.params is not None and want.params is not None
        _same({"snapshot": got.params}, {"snapshot": want.params}, f"round {r}")
    assert guards[0].history == guards[1].history


@pytest.mark.parametrize("how", ["not finite", "over 100 x max"])
def test_a_round_refused_on_whole_model_figures_leaves_every_shard_as_it_was(how: str) -> None:
    cfg = CoordinatorConfig(total_rounds=3, codec_down="int8", chunk_bytes=1 << 16)
    theta = _theta()
    one, cut = _shards(cfg, OuterConfig(), theta, 1), _shards(cfg, OuterConfig(), theta, 3)
    guards = SpikeGuard(cfg.guard), SpikeGuard(cfg.guard)
    for shards, guard in ((one, guards[0]), (cut, guards[1])):
        _round(shards, guard, 0, _deltas(0, "fp32"))
    kept = {k: {n: t.clone() for n, t in v.items()} for k, v in _state(cut).items()}
    deltas = _deltas(1, "fp32")
    if how == "not finite":
        deltas[0]["blocks.2.w"][5] = math.inf  # in the last shard only: every shard keeps its state
    else:
        deltas = [{n: t * 1e8 for n, t in d.items()} for d in deltas]  # finite; the step is over 100 x |θ| of the whole model
    want, _ = _round(one, guards[0], 1, deltas)
    got, sent = _round(cut, guards[1], 1, deltas)
    assert got.rejected and how in str(got.guard) and got.summary() == want.summary()
    _same(_state(cut), kept, "refused")
    assert all(get_codec(c.codec).decode(c.payload, c.numel).count_nonzero() == 0 for c in sent if c.numel)  # a zero update
    assert [c.name for c in sent] == sorted(c.name for c in sent)  # the shards' chunks one after the other: name order


def test_ranges_are_whole_tensors_in_name_order_balanced_by_elements() -> None:
    shapes = {"a": (10,), "b": (10,), "c": (1000,), "d": (10,), "e": (990,), "f": (0,)}
    assert split_ranges(shapes, 1) == (("a", "b", "c", "d", "e", "f"),)
    assert split_ranges(shapes, 2) == (("a", "b", "c"), ("d", "e", "f"))
    three = split_ranges(shapes, 3)
    assert [n for part in three for n in part] == sorted(shapes) and all(three)
    assert split_ranges(shapes, 6) == tuple((n,) for n in sorted(shapes))
    ranges = split_ranges(SHAPES, 3)
    assert [n for part in ranges for n in part] == sorted(SHAPES)
    for bad in (0, len(SHAPES) + 1, 1.5, True):
        with pytest.raises(ValueError, match="coordinator.shards"):
            split_ranges(SHAPES, bad)  # type: ignore[arg-type]


def _held(delta: dict[str, torch.Tensor], codec: str) -> HeldPush:
    """A push as the fused intake keeps it: its payloads, checked."""
    held = HeldPush(fingerprint(delta))
    for c in encode_chunks(delta, codec=make_codec(codec), chunk_bytes=1 << 16):
        held.add(c)
    held.finish()
    return held


def _set_round(shards: ShardSet, r: int, codec: str) -> RoundRecord:
    names, fragment = shards.open(r)
    state = RoundState.open(r, 0.0, names, fragment)
    g = _g(2000 + r)
    for i, tokens in enumerate(TOKENS):
        weight = state.take(PushHeader(site_id=f"s{i}", round=r, tokens=tokens, train_loss=1.0, inner_steps=1), 0.0, None)
        shards.add(_held({n: torch.randn(s, generator=g) * 1e-3 for n, s in SHAPES.items()}, codec), float(weight))
    record, _ = shards.commit(state, Closing(frozenset(), 0.0, 0.0, False), {})
    return record


@pytest.mark.parametrize("codec", ["int8", "topk2bit"])
def test_the_coordinators_shard_set_takes_held_pushes_on_its_threads_and_restores_only_its_own_cut(codec: str) -> None:
    cfg = CoordinatorConfig(total_rounds=4, codec_down="int8", chunk_bytes=1 << 16)
    one, cut = ShardSet(OuterConfig(), cfg), ShardSet(OuterConfig(), dataclasses.replace(cfg, shards=3))
    for s in (one, cut):
        s.install(_theta(), "test")
    assert [len(p.specs) for p in cut.parts] == [len(r) for r in split_ranges(SHAPES, 3)] and cut.hash == one.hash
    for r in range(2):
        want, got = _set_round(one, r, codec), _set_round(cut, r, codec)
        assert got.summary() == want.summary() and not got.rejected
    saved = cut.checkpoint()
    again = ShardSet(OuterConfig(), dataclasses.replace(cfg, shards=3))
    again.restore(copy.deepcopy(saved))  # as from disk (θ and the momentum are by reference); installs θ₀ from it, then the state
    assert again.hash == params_sha256(cut.params)  # (the coordinator sets hash when it publishes a round)
    assert _set_round(again, 2, codec).summary() == _set_round(cut, 2, codec).summary() == _set_round(one, 2, codec).summary()
    for other, state in ((ShardSet(OuterConfig(), cfg), saved), (ShardSet(OuterConfig(), dataclasses.replace(cfg, shards=2)), one.checkpoint())):
        with pytest.raises(ValueError, match="cut into .* shards; this one has coordinator.shards"):
            other.restore(state)
