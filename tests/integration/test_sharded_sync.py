"""Slices (boxes) on the wire: a sharded site's ranks push their own slices as parts of one
push, and pull only the chunks that hold their rows. In-process coordinator, no gRPC (the
layouts' tests run the same paths through torchrun and real gRPC)."""

from __future__ import annotations

import pytest
import torch
from helpers import coordinator, join, push, random_delta

from diloco.boxes import Box, tiling_problem
from diloco.codec import CodecError, get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.errors import CoordinatorError
from diloco.types import PushHeader
from diloco.wire import ChunkAssembler, SliceAssembler, encode_chunks
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)

THETA = {"w": torch.linspace(-1, 1, 48).reshape(6, 8), "b": torch.zeros(5), "e": torch.ones(4, 3, 2)}
SHAPES = {n: tuple(t.shape) for n, t in THETA.items()}
FP32 = get_codec("fp32")
# Two ranks: "w" split by columns (as row-wise tensor parallelism shards a weight), "b" by
# rows, "e" held whole by rank 0.
RANK0 = {"w": Box((0, 0), (6, 3)), "b": Box((0,), (2,)), "e": Box.whole((4, 3, 2))}
RANK1 = {"w": Box((0, 3), (6, 5)), "b": Box((2,), (3,))}


def _two_site_coordinator(**cfg: object) -> Coordinator:
    """Sites a and b joined; ``cfg``: CoordinatorConfig fields over 3 rounds of at least 2 sites."""
    return coordinator(THETA, CoordinatorConfig(**{"total_rounds": 3, "min_sites": 2, **cfg}), sites=("a", "b"))  # type: ignore[arg-type]


def _header(site: str, r: int, part: int = 0, parts: int = 1, tokens: int = 10) -> PushHeader:
    return PushHeader(site_id=site, round=r, tokens=tokens, train_loss=1.0, inner_steps=1, part=part, parts=parts)


def _part(delta: dict[str, torch.Tensor], boxes: dict[str, Box], r: int, codec=FP32, chunk_bytes: int = 40):
    local = {n: delta[n][b.slices()].contiguous() for n, b in boxes.items()}
    return list(encode_chunks(local, codec=codec, chunk_bytes=chunk_bytes, boxes={n: (b, SHAPES[n]) for n, b in boxes.items()}))


def test_tiling_names_overlaps_and_gaps() -> None:
    assert tiling_problem([RANK0["w"], RANK1["w"]], (6, 8)) is None
    assert "overlap" in str(tiling_problem([Box((0, 0), (6, 4)), Box((0, 3), (6, 5))], (6, 8)))
    assert "gap" in str(tiling_problem([Box((0, 0), (6, 3))], (6, 8)))
    assert "leaves the tensor" in str(tiling_problem([Box((0, 0), (7, 8))], (6, 8)))


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_rank_decodes_its_slices_from_whole_tensor_chunks(codec: str) -> None:
    delta = random_delta(THETA, 0)
    chunks = list(encode_chunks(delta, codec=get_codec(codec), chunk_bytes=40))
    whole = ChunkAssembler(fingerprint(THETA))
    for c in chunks:
        whole.add(c)
    reference = whole.finish()
    for boxes in (RANK0, RANK1):
        asm = SliceAssembler(fingerprint(THETA), boxes)
        for c in chunks:
            asm.add(c)
        got = asm.finish()
        for n, b in boxes.items():
            assert torch.equal(got[n], reference[n][b.slices()]), n


def test_a_sharded_push_counts_once_all_parts_arrived_and_equals_a_whole_push() -> None:
    da, db = random_delta(THETA, 1), random_delta(THETA, 2)
    whole, sharded = _two_site_coordinator(), _two_site_coordinator()
    for coord in (whole, sharded):
        assert push(coord, "a", 0, da).accepted
    push(whole, "b", 0, db)
    first = sharded.push(_header("b", 0, part=1, parts=2), _part(db, RANK1, 0))
    assert first.accepted and sharded.committed_rounds == 0  # waits for the site's other part
    assert sharded.push(_header("b", 0, part=1, parts=2), _part(db, RANK1, 0)).duplicate
    sharded.push(_header("b", 0, part=0, parts=2), _part(db, RANK0, 0))
    assert sharded.committed_rounds == 1
    assert sharded.global_sha256() == whole.global_sha256()  # the same θ, bit for bit


def test_overlapping_or_gapped_parts_are_refused_and_theta_stays() -> None:
    coord = _two_site_coordinator()
    before = coord.global_sha256()
    d = random_delta(THETA, 3)
    coord.push(_header("b", 0, part=0, parts=2), _part(d, RANK0, 0))
    overlap = {"w": Box((0, 2), (6, 6)), "b": Box((2,), (3,))}
    with pytest.raises(CoordinatorError, match=r"overlaps slice \[0:6, 0:3\] of part 0"):
        coord.push(_header("b", 0, part=1, parts=2), _part(d, overlap, 0))
    gap = {"w": Box((0, 4), (6, 4)), "b": Box((2,), (3,))}
    with pytest.raises(CoordinatorError, match="gap"):
        coord.push(_header("b", 0, part=1, parts=2), _part(d, gap, 0))
    with pytest.raises(CoordinatorError, match="parts=2, tokens=10"):
        coord.push(_header("a", 0, part=0, parts=2, tokens=10), _part(d, RANK0, 0))
        coord.push(_header("a", 0, part=1, parts=2, tokens=11), _part(d, RANK1, 0))
    with pytest.raises(CoordinatorError, match="part=2: must be in 0..1"):
        coord.push(_header("a", 0, part=2, parts=2), _part(d, RANK1, 0))
    assert coord.committed_rounds == 0 and coord.global_sha256() == before


def test_a_slice_outside_its_tensor_is_refused() -> None:
    coord = _two_site_coordinator()
    d = random_delta(THETA, 4)
    bad = _part(d, RANK1, 0)
    i = next(i for i, c in enumerate(bad) if c.name == "w")
    bad[i] = type(bad[i])(**{**bad[i].__dict__, "box_start": (0, 4)})  # [0:6, 4:9] leaves w
    with pytest.raises(CoordinatorError, match="leaves the tensor"):
        coord.push(_header("b", 0, part=1, parts=2), bad)
    with pytest.raises(CodecError, match="is for slice"):
        SliceAssembler(fingerprint(THETA), RANK0).add(_part(d, RANK1, 0)[0])


def test_pulls_of_slices_carry_only_the_chunks_of_their_rows() -> None:
    coord = _two_site_coordinator(chunk_bytes=32)  # 8 floats per chunk: w is 6 chunks, one per row
    for s in ("a", "b"):
        push(coord, s, 0, random_delta(THETA, 5))
    rows = {"w": Box((2, 0), (2, 8))}  # rows 2 and 3 of w
    chunks = coord.pull_update("a", 0, want=rows)
    assert [(c.name, c.offset) for c in chunks] == [("w", 16), ("w", 24)]
    everything = coord.pull_update("a", 0)
    asm = SliceAssembler(fingerprint(THETA), rows)
    for c in chunks:
        asm.add(c)
    full = ChunkAssembler(fingerprint(THETA))
    for c in everything:
        full.add(c)
    assert torch.equal(asm.finish()["w"], full.finish()["w"][2:4])
    with pytest.raises(CoordinatorError, match="unknown parameter 'nope'"):
        coord.pull_update("a", 0, want={"nope": Box((0,), (1,))})


@pytest.mark.parametrize(("codec", "cut"), [("fp32", True), ("bf16", True), ("fp16", True), ("int8", False)])
def test_float_payloads_are_cut_to_a_ranks_rows(codec: str, cut: bool) -> None:
    coord = _two_site_coordinator(codec_down=codec)  # each tensor is one chunk
    for s in ("a", "b"):
        push(coord, s, 0, random_delta(THETA, 6))
    rows = {"w": Box((2, 0), (2, 8)), "e": Box((1, 0, 0), (3, 3, 2))}
    chunks = coord.pull_update("a", 0, want=rows)
    assert [(c.name, c.offset, c.numel) for c in chunks] == ([("e", 6, 18), ("w", 16, 16)] if cut else [("e", 0, 24), ("w", 0, 48)])
    full = ChunkAssembler(fingerprint(THETA))
    for c in coord.pull_update("a", 0):
        full.add(c)
    whole = full.finish()
    asm = SliceAssembler(fingerprint(THETA), rows)
    for c in chunks:
        asm.add(c)
    got = asm.finish()
    for n, b in rows.items():
        assert torch.equal(got[n], whole[n][b.slices()])  # the cut payloads decode to the same values


def test_the_round_record_says_what_each_part_held() -> None:
    coord = _two_site_coordinator()
    records = []
    coord.on_commit.append(records.append)
    d = random_delta(THETA, 7)
    push(coord, "a", 0, d)
    coord.push(_header("b", 0, part=0, parts=2), _part(d, RANK0, 0))
    coord.push(_header("b", 0, part=1, parts=2), _part(d, RANK1, 0))
    assert records[0].sliced == {"b": [{"part": 0, "whole": 1, "sliced": 2, "numel": 18 + 2 + 24}, {"part": 1, "whole": 0, "sliced": 2, "numel": 30 + 3}]}


def test_a_site_that_joins_again_pushes_all_its_parts_again() -> None:
    # A restarted sharded site (torchrun started again) joins with the same id: a part its
    # previous incarnation pushed must not be combined with the new incarnation's parts.
    coord = _two_site_coordinator()
    old, new = random_delta(THETA, 8), random_delta(THETA, 9)
    push(coord, "a", 0, random_delta(THETA, 1))
    assert coord.push(_header("b", 0, part=0, parts=2), _part(old, RANK0, 0)).accepted
    join(coord, THETA, "b")  # the site's ranks come back
    coord.push(_header("b", 0, part=1, parts=2), _part(new, RANK1, 0))
    assert coord.committed_rounds == 0  # part 0 of the old incarnation was forgotten
    coord.push(_header("b", 0, part=0, parts=2), _part(new, RANK0, 0))
    reference = _two_site_coordinator()
    push(reference, "a", 0, random_delta(THETA, 1))
    push(reference, "b", 0, new)
    assert coord.committed_rounds == 1 and coord.global_sha256() == reference.global_sha256()
