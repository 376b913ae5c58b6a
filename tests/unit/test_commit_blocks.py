"""The blockwise in-place commit (diloco.coordinator.commit_blocks) against the generic path:
two shards fed the same pushes, one committing block by block where it applies, the other
always on the generic path, agree bit for bit every round (θ and its hash, the momentum, the
downlink residual, the chunks' bytes, the norms and the records) over int8 / int4+zstd / fp32 /
fp32+zstd downlinks, with and without error feedback, an lr and momentum schedule, fragments
with a flush round, a round the guard refuses, odd tensor sizes and an empty tensor, chunks
and int8 blocks of odd sizes (the norms' lanes taken block by block too); the rounds it
cannot take (other optimizers, aggregates and codecs, averaging rounds) go
to the generic path; a refused round leaves θ, the momentum and the residual as they were;
a round whose checks it cannot settle in its first pass goes to the generic path too; and a
commit at 8M parameters peaks well under the generic path's memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT
from helpers import generator as _g

from diloco.codec import CodecConfig, get_codec
from diloco.coordinator import commit_blocks, kernels
from diloco.coordinator.commit import Closing, RoundRecord, UpdateEncoder
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.guard import GuardConfig
from diloco.coordinator.round_state import RoundState
from diloco.coordinator.shard import Shard
from diloco.outer import OuterConfig, l2, params_sha256
from diloco.types import Chunk, PushHeader
from diloco.wire import fingerprint

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(kernels.native is None, reason="the compiled loops are not built here (setup.py)")]

# Odd sizes: a tensor whose chunks end off any vector width, a 2-D one, a single element and an empty one.
SHAPES = {"blocks.0.w": (1_000_003,), "blocks.0.b": (37,), "blocks.1.w": (129, 517), "blocks.1.b": (1,), "blocks.1.e": (0,), "head": (64,)}
TOKENS = (100, 250, 77)


@contextmanager
def _path(blockwise: bool) -> Iterator[None]:
    before = commit_blocks.ENABLED
    commit_blocks.ENABLED = blockwise
    try:
        yield
    finally:
        commit_blocks.ENABLED = before


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rounds the blockwise path applied (its second pass), in order."""
    rounds: list[int] = []
    apply = commit_blocks.BlockCommit.apply

    def counted(self: commit_blocks.BlockCommit, *args: Any, **kwargs: Any) -> str:
        rounds.append(self.round)
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(commit_blocks.BlockCommit, "apply", counted)
    return rounds


def _theta(shapes: Mapping[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.Tensor]:
    g = _g(7)
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}


def _deltas(r: int, shapes: Mapping[str, tuple[int, ...]] = SHAPES, scale: float = 1e-3) -> list[dict[str, torch.Tensor]]:
    g = _g(1000 + r)
    return [{n: torch.randn(s, generator=g) * scale * (1 + i) for n, s in shapes.items()} for i in range(len(TOKENS))]


def _shard(cfg: CoordinatorConfig, outer: OuterConfig, theta: Mapping[str, torch.Tensor]) -> Shard:
    shard = Shard(outer, cfg)
    shard.install(theta, "test")
    return shard


def _commit(shard: Shard, r: int, deltas: list[dict[str, torch.Tensor]], blockwise: bool) -> tuple[RoundRecord, list[Chunk]]:
    names, fragment = shard.open(r)
    state = RoundState.open(r, 0.0, names, fragment)
    for i, (delta, tokens) in enumerate(zip(deltas, TOKENS, strict=True)):
        weight = state.take(PushHeader(site_id=f"s{i}", round=r, tokens=tokens, train_loss=1.0, inner_steps=1), 0.0, None)
        shard.add({n: delta[n] for n in names}, float(weight))
    with _path(blockwise):
        return shard.commit(state, Closing(frozenset(), 0.0, 0.0, False), {})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same_tensors(a: Mapping[str, torch.Tensor] | None, b: Mapping[str, torch.Tensor] | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is None or b is None:
        return
    assert list(a) == list(b), what
    for n in a:
        assert a[n].shape == b[n].shape and torch.equal(_bits(a[n]), _bits(b[n])), f"{what}: {n} differs"


def _momentum(shard: Shard) -> dict[str, torch.Tensor]:
    assert shard.outer is not None
    opt = shard.outer._opt  # noqa: SLF001 - the state the two paths must leave alike
    return {n: opt.state[p]["momentum_buffer"] for n, p in shard.outer.params.items() if p in opt.state and "momentum_buffer" in opt.state[p]}


def _same_shards(a: Shard, b: Shard) -> None:
    assert a.outer is not None and b.outer is not None and a.encoder is not None and b.encoder is not None
    _same_tensors(a.outer.params, b.outer.params, "θ")
    _same_tensors(_momentum(a), _momentum(b), "momentum")
    assert a.outer._opt.state_dict()["param_groups"] == b.outer._opt.state_dict()["param_groups"]  # noqa: SLF001
    residual_a = a.encoder.feedback.residual if a.encoder.feedback is not None else None
    residual_b = b.encoder.feedback.residual if b.encoder.feedback is not None else None
    _same_tensors(residual_a, residual_b, "residual")
    assert a.outer.update_norm == b.outer.update_norm
    assert a.guard.history == b.guard.history


def _wire(chunks: list[Chunk]) -> list[tuple[Any, ...]]:
    return [(c.name, c.shape, c.dtype, c.offset, c.numel, c.codec, bytes(c.payload), c.box_start, c.box_shape) for c in chunks]


CASES = {
    "int8-error-feedback": (CoordinatorConfig(total_rounds=6, codec_down="int8", chunk_bytes=1 << 16), OuterConfig()),
    # Chunks of 65065 elements and int8 blocks of 1001: neither a multiple of any vector width.
    "int8-odd-blocks": (CoordinatorConfig(total_rounds=4, codec_down=CodecConfig(name="int8", block=1001), chunk_bytes=1 << 16), OuterConfig()),
    "int8-no-feedback": (CoordinatorConfig(total_rounds=4, codec_down="int8", error_feedback_down=False), OuterConfig()),
    "int4+zstd": (CoordinatorConfig(total_rounds=4, codec_down="int4+zstd", chunk_bytes=1 << 15), OuterConfig(lr=0.5, momentum=0.8)),
    "fp32": (CoordinatorConfig(total_rounds=4, codec_down="fp32", chunk_bytes=1 << 16), OuterConfig()),
    "fp32+zstd": (CoordinatorConfig(total_rounds=3, codec_down="fp32+zstd", chunk_bytes=1 << 16), OuterConfig()),  # chunks of 16311: odd
    "schedule": (
        CoordinatorConfig(total_rounds=6, codec_down="int8", chunk_bytes=1 << 16),
        OuterConfig(lr_warmup=2, lr_decay="cosine", lr_min_ratio=0.1, momentum_warmup=3),  # momentum 0 at the first step
    ),
    "fragments-and-flush": (CoordinatorConfig(total_rounds=7, codec_down="int8", fragments=2, flush_rounds=1, chunk_bytes=1 << 16), OuterConfig()),
    "guard": (CoordinatorConfig(total_rounds=6, codec_down="int8", guard=GuardConfig(factor=3.0, window=3, min_rounds=2)), OuterConfig()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_blockwise_commit_is_the_generic_one_bit_for_bit(case: str, applied: list[int]) -> None:
    cfg, outer = CASES[case]
    theta = _theta()
    blockwise, generic = _shard(cfg, outer, theta), _shard(cfg, outer, theta)
    spike = 3 if case == "guard" else None
    for r in range(cfg.total_rounds):
        deltas = _deltas(r)
        if r == spike:
            deltas = [{n: t * 100 for n, t in d.items()} for d in deltas]
        got, sent = _commit(blockwise, r, deltas, blockwise=True)
        want, expected = _commit(generic, r, deltas, blockwise=False)
        assert got.summary() == want.summary(), f"round {r}"
        assert _wire(sent) == _wire(expected), f"round {r}"
        assert got.global_sha256 == params_sha256(blockwise.outer.params)  # type: ignore[union-attr]
        _same_shards(blockwise, generic)
        assert got.rejected == (r == spike)
    stepped = [r for r in range(cfg.total_rounds) if r != spike]
    assert applied == stepped  # every other round on the blockwise path, the flush round's average too


def test_a_refused_round_leaves_theta_the_momentum_and_the_residual_as_they_were(applied: list[int]) -> None:
    cfg = CoordinatorConfig(total_rounds=4, codec_down="int8", chunk_bytes=1 << 16)
    shard = _shard(cfg, OuterConfig(), _theta())
    _commit(shard, 0, _deltas(0), blockwise=True)
    assert shard.outer is not None and shard.encoder is not None and shard.encoder.feedback is not None
    kept = ({n: p.clone() for n, p in shard.outer.params.items()}, {n: b.clone() for n, b in _momentum(shard).items()})
    residual = shard.encoder.feedback.residual
    assert residual is not None
    kept_residual = {n: t.clone() for n, t in residual.items()}
    inf = _deltas(1)
    inf[0]["blocks.1.w"][3, 5] = math.inf  # the mean is not finite: refused after the first pass
    absurd = [{n: t * 1e8 for n, t in d.items()} for d in _deltas(2)]  # finite, and the step is over 100 x |θ|
    for r, deltas, why in ((1, inf, "not finite"), (2, absurd, "over 100 x max")):
        record, chunks = _commit(shard, r, deltas, blockwise=True)
        assert record.rejected and why in str(record.guard) and record.update_norm == 0.0
        _same_tensors(shard.outer.params, kept[0], "θ")
        _same_tensors(_momentum(shard), kept[1], "momentum")
        assert shard.encoder.feedback.residual is residual
        _same_tensors(residual, kept_residual, "residual")
        assert all(not c.payload or get_codec(c.codec).decode(c.payload, c.numel).count_nonzero() == 0 for c in chunks)  # a zero update
    assert applied == [0]


def test_a_round_whose_sent_update_it_cannot_vouch_for_goes_to_the_generic_path(applied: list[int]) -> None:
    """|θ| = 0, so the limit is 100; one value per int8 block of 1024 puts the bound on |ũ| at
    32 x |u| (every value of a block could decode to its absmax) while ũ itself is about u:
    the first pass cannot be sure, the generic path steps (and accepts)."""
    shapes = {"w": (1024 * 16,)}
    theta = {"w": torch.zeros(shapes["w"])}
    cfg = CoordinatorConfig(total_rounds=2, codec_down="int8")
    blockwise, generic = _shard(cfg, OuterConfig(), theta), _shard(cfg, OuterConfig(), theta)
    spiky = torch.zeros(shapes["w"])
    spiky[::1024] = 1.0  # |u| = 0.7 x 1.9 x 4 = 5.3 (lr 0.7, Nesterov 1 + 0.9); the bound 170 > 100
    deltas = [{"w": spiky.clone()} for _ in TOKENS]
    got, sent = _commit(blockwise, 0, deltas, blockwise=True)
    want, expected = _commit(generic, 0, deltas, blockwise=False)
    assert not got.rejected and got.summary() == want.summary() and _wire(sent) == _wire(expected)
    _same_shards(blockwise, generic)
    assert applied == []


def test_an_update_the_encoder_would_refuse_goes_to_the_generic_path_which_refuses_it(applied: list[int]) -> None:
    """x = u + residual overflows float32 (the residual as a previous round could leave it near
    float32's max): the first pass sees x is not finite, the generic path's encoder refuses it."""
    theta = {"w": torch.full((256,), 1e36)}
    cfg = CoordinatorConfig(total_rounds=2, codec_down="int8")
    shards = [_shard(cfg, OuterConfig(), theta) for _ in range(2)]
    for shard in shards:
        assert shard.encoder is not None and shard.encoder.feedback is not None
        shard.encoder.feedback.residual = {"w": torch.full((256,), 3.4e38)}
    deltas = [{"w": torch.full((256,), -1e37)} for _ in TOKENS]  # u = +1.33e37: x = 3.4e38 + 1.33e37 = inf
    got, _ = _commit(shards[0], 0, deltas, blockwise=True)
    want, _ = _commit(shards[1], 0, deltas, blockwise=False)
    assert got.rejected and "CodecError" in str(got.guard) and got.summary() == want.summary()
    _same_shards(*shards)
    assert torch.equal(shards[0].outer.params["w"], theta["w"])  # type: ignore[union-attr]
    assert applied == []


FALLBACKS = {
    "adam": (CoordinatorConfig(total_rounds=2), OuterConfig(name="Adam", lr=0.01)),
    "heavy-ball": (CoordinatorConfig(total_rounds=2), OuterConfig(nesterov=False)),
    "no-momentum": (CoordinatorConfig(total_rounds=2), OuterConfig(momentum=0.0)),
    "weight-decay": (CoordinatorConfig(total_rounds=2), OuterConfig(kwargs={"weight_decay": 0.1})),
    "delayed-nesterov": (CoordinatorConfig(total_rounds=2), OuterConfig(name="DelayedNesterov")),
    "nonzero": (CoordinatorConfig(total_rounds=2, aggregate="nonzero"), OuterConfig()),
    "median": (CoordinatorConfig(total_rounds=2, aggregate="median"), OuterConfig()),
    "fp16-downlink": (CoordinatorConfig(total_rounds=2, codec_down="fp16"), OuterConfig()),
    "topk-downlink": (CoordinatorConfig(total_rounds=2, codec_down="topk2bit"), OuterConfig()),
}


@pytest.mark.parametrize(
    "outer", [OuterConfig(final_average=True), OuterConfig(name="Adam", lr=0.01, final_average=True), OuterConfig(name="DelayedNesterov", final_average=True)]
)
def test_an_averaging_round_takes_the_blockwise_path_for_any_optimizer_and_leaves_its_state(outer: OuterConfig, applied: list[int]) -> None:
    """The last round averages (θ − mean Δ, final_average): block by block, the generic path's
    bits (θ, the residual, the chunks, the record), and the optimizer's state and settings as
    the round before left them."""
    cfg = CoordinatorConfig(total_rounds=2, codec_down="int8", chunk_bytes=1 << 16)
    blockwise, generic = _shard(cfg, outer, _theta()), _shard(cfg, outer, _theta())
    for r in range(2):
        deltas = _deltas(r)
        got, sent = _commit(blockwise, r, deltas, blockwise=True)
        want, expected = _commit(generic, r, deltas, blockwise=False)
        assert got.summary() == want.summary() and not got.rejected, f"round {r}"
        assert _wire(sent) == _wire(expected), f"round {r}"
        _same_shards(blockwise, generic)
        if r == 0:
            kept = blockwise.outer._opt.state_dict()  # type: ignore[union-attr]  # noqa: SLF001
            kept_state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in kept["state"].items()}
    after = blockwise.outer._opt.state_dict()  # type: ignore[union-attr]  # noqa: SLF001
    assert after["param_groups"] == kept["param_groups"]
    assert {k: {n: v.tolist() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in after["state"].items()} == {
        k: {n: v.tolist() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in kept_state.items()
    }
    assert applied == ([0, 1] if outer.name == "SGD" else [1])


@pytest.mark.parametrize("case", [*FALLBACKS, "switched-off"])
def test_the_rounds_it_does_not_take_go_to_the_generic_path(case: str, applied: list[int]) -> None:
    cfg, outer = FALLBACKS.get(case, (CoordinatorConfig(total_rounds=2), OuterConfig()))
    shapes = {"blocks.0.w": (300, 7), "blocks.0.b": (7,)}
    shard = _shard(cfg, outer, _theta(shapes))
    record, _ = _commit(shard, 0, _deltas(0, shapes), blockwise=case != "switched-off")
    assert not record.rejected and record.global_sha256 == params_sha256(shard.outer.params)  # type: ignore[union-attr]
    assert applied == []


def test_the_default_round_takes_the_blockwise_path_and_the_checkpoint_holds_theta_itself(applied: list[int]) -> None:
    shapes = {"blocks.0.w": (300, 7), "blocks.0.b": (7,)}
    shard = _shard(CoordinatorConfig(total_rounds=3), OuterConfig(), _theta(shapes))
    _commit(shard, 0, _deltas(0, shapes), blockwise=True)
    buffers = _momentum(shard)
    _commit(shard, 1, _deltas(1, shapes), blockwise=True)
    assert applied == [0, 1]
    assert all(_momentum(shard)[n] is b for n, b in buffers.items())  # written in place: the same tensors
    assert shard.outer is not None
    held = shard.checkpoint()["outer"]["params"]
    assert all(held[n] is p for n, p in shard.outer.params.items())  # a reference: no copy of θ per checkpoint


@pytest.mark.parametrize("codec", ["int8", "fp32", "int4+zstd"])
def test_a_refused_rounds_zero_update_is_encoded_as_the_zero_tensors_were(codec: str) -> None:
    specs = fingerprint({n: torch.zeros(s) for n, s in SHAPES.items()})
    encoder = UpdateEncoder.of(get_codec(codec), specs, 1 << 15, True)
    want = encoder.encode({n: torch.zeros(s) for n, s in SHAPES.items()})
    assert _wire(encoder.encode_zeros(list(SHAPES))) == _wire(want)


def test_lanes_taken_in_blocks_of_any_size_are_the_whole_tensors_lanes() -> None:
    g = _g(5)
    values = torch.randn(10_007, generator=g) * torch.logspace(-3, 3, 10_007)
    whole = kernels.lanes()
    kernels.native.sumsq_f32(values.numpy(), whole)
    lanes = kernels.lanes()
    for offset in range(0, values.numel(), 1001):
        k = min(1001, values.numel() - offset)
        block = values[offset : offset + k]
        with commit_blocks._lanes_from(lanes, offset) as block_lanes:  # noqa: SLF001 - the rotation the second pass relies on
            kernels.native.outer_apply(torch.zeros(k).numpy(), block.numpy(), torch.zeros(k).numpy(), None, block_lanes)
    assert lanes.tobytes() == whole.tobytes()


def test_the_compiled_loops_give_torchs_bits_here() -> None:
    """Where they do not (a CPU whose torch kernels round otherwise), every round takes the
    generic path: correct, without the blockwise path's memory and time."""
    assert kernels.available(), "the compiled outer step differs from torch's on this machine: the coordinator commits on the generic path only"


def test_the_coordinators_norm_is_l2_up_to_rounding_and_int8_decodes_into_a_buffer_as_it_decodes() -> None:
    g = _g(3)
    tensors = {"a": torch.randn(100_003, generator=g), "b": torch.randn(5, 7, generator=g), "c": torch.zeros(0)}
    assert kernels.norm(tensors) == pytest.approx(l2(tensors), rel=1e-12)
    assert kernels.norm({}) == 0.0
    assert kernels.norm({"a": torch.tensor([1.0, math.nan])}) != kernels.norm({"a": torch.tensor([1.0, math.nan])})  # nan
    assert kernels.norm({"a": torch.tensor([1.0]), "b": torch.tensor([-math.inf])}) == math.inf
    assert kernels.norm({"a": torch.tensor([3.4e38, 3.4e38])}) == pytest.approx(3.4e38 * math.sqrt(2), rel=1e-6)
    codec = get_codec("int8")
    x = torch.randn(5000, generator=g)
    payload = codec.encode(x)
    out = torch.empty(5000)
    codec.decode_into(payload, 5000, out)  # type: ignore[attr-defined]
    assert torch.equal(_bits(out), _bits(codec.decode(payload, 5000)))


@pytest.mark.timeout(300)
def test_a_commit_at_8m_parameters_peaks_far_below_the_generic_paths_memory(tmp_path: Path) -> None:
    """scripts/bench_commit_memory.py in its own process: the coordinator's whole peak memory
    above its imports stays within 12 B/param of its state's own 20 (θ 4, the float64 sums 8,
    the momentum 4, the residual 4) in every round; the generic path's peaks near 50."""
    out = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_commit_memory.py"), "--params", "8000000", "--rounds", "3", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=280)
    rounds = json.loads(out.read_text())["rounds"]
    per_param = [r["peak_mib"] * (1 << 20) / 8_000_000 for r in rounds]
    assert len(per_param) == 3 and max(per_param) <= 20 + 12, per_param
