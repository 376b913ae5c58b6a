"""Property tests of the chunk validators (ChunkAssembler, check_part, SliceAssembler) and of
boxes: valid chunk streams reassemble exactly in any order the rules allow, and any mutation
of a chunk (header field, payload, duplicate, drop, reorder) either changes nothing or is
refused with a CodecError whose message stays short; no other exception ever escapes."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from math import prod
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from diloco.boxes import Box, tiling_problem
from diloco.codec import CodecError, get_codec, known_codecs, make_codec
from diloco.types import Chunk, TensorSpec
from diloco.wire import MAX_CHUNK_BYTES, ChunkAssembler, SliceAssembler, check_part, chunks_overlapping, encode_chunks, fingerprint

# derandomize: CI and a laptop run the same examples; database=None: nothing written to the checkout.
PROPERTY = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MESSAGE = 1500  # an error message never grows with the input that caused it

INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_INT = st.one_of(st.integers(-3, 9), INT64, st.sampled_from([2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, -(2**63)]))
DIMS = st.one_of(
    st.lists(EDGE_INT, max_size=4).map(tuple),
    st.just((2**62, 2**62, 2**62)),  # a product far past int64
    st.just(tuple(range(1, 2001))),  # many dimensions: the message must stay short
)
LONG = "x" * 10_000
NAMES = ["a", "b.weight", "c.bias", "layer.0.w"]

Tensors = dict[str, torch.Tensor]


# ---- strategies -------------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn, max_dims: int = 3) -> Tensors:
    """1-3 small float32 tensors, zero-sized and 0-d ones included, of assorted magnitudes."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=max_dims)))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        out[name] = torch.randn(shape, generator=g) * draw(st.sampled_from([1.0, 0.0, 1e-30, 1e30]))
    return out


@st.composite
def codecs(draw: st.DrawFn) -> tuple[Any, int]:
    """A codec under non-default parameters (the receiver decodes with the default instance:
    parameters travel in the payload) and a chunk size small enough for several chunks."""
    name = draw(st.sampled_from(known_codecs()))
    base = name.removesuffix("+zstd")
    kw: dict[str, Any] = {}
    if base in ("int8", "int4", "e3m0"):
        kw["block"] = draw(st.sampled_from([1, 2, 3, 7, 16, 1024]))
    elif base == "topk2bit":
        kw["block"] = draw(st.sampled_from([32, 33, 64, 4096]))
        kw["density"] = draw(st.sampled_from([0.02, 0.05, 0.5, 1.0]))
    if name.endswith("+zstd"):
        kw["zstd_level"] = draw(st.sampled_from([-5, 1, 3]))
    codec = make_codec(name, **kw)
    need = codec.encoded_size(1)
    return codec, draw(st.integers(need, need + 300))


HEADER_MUTATION = st.one_of(
    st.tuples(st.just("name"), st.one_of(st.sampled_from(NAMES), st.text(max_size=8), st.just(LONG))),
    st.tuples(st.just("shape"), DIMS),
    st.tuples(st.just("dtype"), st.one_of(st.sampled_from(["float32", "float16", "bfloat16", ""]), st.text(max_size=8), st.just(LONG))),
    st.tuples(st.just("offset"), EDGE_INT),
    st.tuples(st.just("numel"), EDGE_INT),
    st.tuples(st.just("codec"), st.one_of(st.sampled_from(known_codecs()), st.text(max_size=8), st.just(LONG))),
    st.tuples(st.just("box_start"), DIMS),
    st.tuples(st.just("box_shape"), DIMS),
    st.tuples(st.just("whole_box"), st.none()),  # the whole tensor as an explicit box: same chunk
    st.tuples(st.just("duplicate"), st.integers(0, 10**6)),
    st.tuples(st.just("drop"), st.none()),
    st.tuples(st.just("swap"), st.integers(0, 10**6)),
)
PAYLOAD_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.tuples(st.integers(0, 10**6), st.integers(0, 7))),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("replace"), st.binary(max_size=64)),
    st.tuples(st.just("oversize"), st.integers(1, 64)),
)
PAYLOAD_KINDS = {"flip", "truncate", "extend", "replace", "oversize"}


def mutate(chunks: list[Chunk], at: int, mutation: tuple[str, Any]) -> list[Chunk]:
    """``chunks`` with ``mutation`` applied to chunk ``at`` (modulo their number)."""
    out = list(chunks)
    i = at % len(out)
    c, (kind, arg) = out[i], mutation
    if kind == "duplicate":
        out.insert(arg % (len(out) + 1), c)
    elif kind == "drop":
        del out[i]
    elif kind == "swap":
        j = arg % len(out)
        out[i], out[j] = out[j], out[i]
    elif kind == "whole_box":
        out[i] = dataclasses.replace(c, box_start=c.box.start, box_shape=c.box.shape)
    elif kind == "flip":
        if c.payload:
            pos, bit = arg[0] % len(c.payload), arg[1]
            out[i] = dataclasses.replace(c, payload=c.payload[:pos] + bytes([c.payload[pos] ^ (1 << bit)]) + c.payload[pos + 1 :])
    elif kind == "truncate":
        out[i] = dataclasses.replace(c, payload=c.payload[: arg % (len(c.payload) + 1)])
    elif kind == "extend":
        out[i] = dataclasses.replace(c, payload=c.payload + arg)
    elif kind == "replace":
        out[i] = dataclasses.replace(c, payload=arg)
    elif kind == "oversize":
        out[i] = dataclasses.replace(c, payload=c.payload + bytes(MAX_CHUNK_BYTES + arg - len(c.payload)))
    else:
        out[i] = dataclasses.replace(c, **{kind: arg})
    return out


# ---- helpers ----------------------------------------------------------------------------


def reference(t: Tensors, chunks: Iterable[Chunk]) -> Tensors:
    """Each chunk decoded on its own and put in place: what any assembler must produce."""
    flat: dict[tuple[str, Box], torch.Tensor] = {}
    for c in chunks:
        buf = flat.setdefault((c.name, c.box), torch.full((c.box.numel,), float("nan")))
        buf[c.offset : c.offset + c.numel] = get_codec(c.codec).decode(c.payload, c.numel)
    out = {n: torch.full(x.shape, float("nan")) for n, x in t.items()}
    for (name, box), buf in flat.items():
        out[name][box.slices()] = buf.view(box.shape)
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def assert_same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == torch.float32 and got[n].shape == want[n].shape, n
        assert torch.equal(bits(got[n]), bits(want[n])), n


def outcome(fn: Callable[[], Tensors], what: str = "") -> Tensors | CodecError:
    """The tensors, or the CodecError; any other exception fails the test."""
    try:
        got = fn()
    except CodecError as e:
        assert len(str(e)) <= MAX_MESSAGE, f"a {len(str(e))}-character message: {str(e)[:200]}..."
        event(f"{what}: refused")
        return e
    event(f"{what}: decoded")
    return got


def assert_well_formed(got: Tensors | CodecError, want: Tensors) -> None:
    if isinstance(got, CodecError):
        return
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].shape == want[n].shape and torch.isfinite(got[n]).all()


def assemble(specs: Mapping[str, TensorSpec], chunks: Iterable[Chunk]) -> Tensors:
    asm = ChunkAssembler(specs)
    for c in chunks:
        asm.add(c)
    return asm.finish()


def interleave(streams: list[list[Chunk]], order: list[int]) -> list[Chunk]:
    """The streams merged, each kept in its own order: at step i take the next chunk of the
    ``order[i]``-th stream (modulo those not yet exhausted)."""
    queues = [list(s) for s in streams if s]
    out = []
    for i in itertools.count():
        if not queues:
            return out
        q = queues[order[i % len(order)] % len(queues)] if order else queues[0]
        out.append(q.pop(0))
        queues = [q for q in queues if q]


def streams_of(chunks: list[Chunk]) -> list[list[Chunk]]:
    """The chunks of each (tensor, slice), in their order."""
    by_key: dict[tuple[str, Box], list[Chunk]] = {}
    for c in chunks:
        by_key.setdefault((c.name, c.box), []).append(c)
    return list(by_key.values())


# ---- ChunkAssembler ---------------------------------------------------------------------


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=60)
@given(t=tensors(), codec=codecs(), order=st.lists(st.integers(0, 7), max_size=20))
@example(t={"e": torch.zeros(0, 3), "s": torch.tensor(1.5)}, codec=(get_codec("fp32"), 4), order=[]).via("bug: an empty tensor never assembled")
def test_valid_chunks_reassemble_exactly_in_any_allowed_order(t: Tensors, codec: tuple[Any, int], order: list[int]) -> None:
    codec, chunk_bytes = codec
    chunks = list(encode_chunks(t, codec=codec, chunk_bytes=chunk_bytes))
    assert all(len(c.payload) <= chunk_bytes for c in chunks)
    shuffled = interleave(streams_of(chunks), order)
    got = assemble(fingerprint(t), shuffled)
    assert_same(got, reference(t, chunks))
    if codec.name in ("fp32", "fp32+zstd"):
        assert_same(got, t)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=40)
@given(t=tensors(), permutation=st.permutations(range(12)))
def test_any_permutation_reassembles_the_same_or_is_refused(t: Tensors, permutation: list[int]) -> None:
    chunks = list(encode_chunks(t, codec=get_codec("fp32"), chunk_bytes=8))
    order = sorted(range(len(chunks)), key=lambda i: permutation[i % 12] + 12 * (i // 12))
    got = outcome(lambda: assemble(fingerprint(t), [chunks[i] for i in order]), "permuted")
    if not isinstance(got, CodecError):
        assert_same(got, t)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=400)
@given(t=tensors(), codec=codecs(), at=st.integers(0, 10**6), mutation=HEADER_MUTATION)
@example(t={"w": torch.ones(3)}, codec=(get_codec("fp32"), 64), at=0, mutation=("name", LONG)).via("bug: a 10,000-character message")
def test_a_mutated_header_changes_nothing_or_is_refused(t: Tensors, codec: tuple[Any, int], at: int, mutation: tuple[str, Any]) -> None:
    codec, chunk_bytes = codec
    chunks = list(encode_chunks(t, codec=codec, chunk_bytes=chunk_bytes))
    got = outcome(lambda: assemble(fingerprint(t), mutate(chunks, at, mutation)), mutation[0])
    if not isinstance(got, CodecError):
        assert_same(got, reference(t, chunks))


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=400)
@given(t=tensors(), codec=codecs(), at=st.integers(0, 10**6), mutation=PAYLOAD_MUTATION)
@example(t={"w": torch.ones(3)}, codec=(get_codec("fp32+zstd"), 100), at=0, mutation=("oversize", 1)).via("bug: a payload over 1 MiB was decoded")
def test_a_mutated_payload_decodes_to_finite_values_or_is_refused(t: Tensors, codec: tuple[Any, int], at: int, mutation: tuple[str, Any]) -> None:
    codec, chunk_bytes = codec
    chunks = list(encode_chunks(t, codec=codec, chunk_bytes=chunk_bytes))
    mutated = mutate(chunks, at, mutation)
    got = outcome(lambda: assemble(fingerprint(t), mutated), mutation[0])
    assert_well_formed(got, t)
    changed = [c for c, m in zip(chunks, mutated) if c.payload != m.payload]
    if mutation[0] == "oversize":
        assert isinstance(got, CodecError) and f"limit of {MAX_CHUNK_BYTES}" in str(got)
    if changed and codec.name == "fp32" and mutation[0] in ("truncate", "extend"):
        assert isinstance(got, CodecError)  # fp32 carries 4 bytes per element exactly


@pytest.mark.timeout(120)
def test_a_payload_over_the_limit_is_refused_naming_size_and_limit() -> None:
    t = {"w": torch.ones(4)}
    c = next(encode_chunks(t, codec=get_codec("fp32+zstd")))
    big = dataclasses.replace(c, payload=c.payload + bytes(MAX_CHUNK_BYTES))
    for check in (lambda: ChunkAssembler(fingerprint(t)).add(big), lambda: check_part(fingerprint(t), [big])):
        with pytest.raises(CodecError, match=f"{len(big.payload)} bytes.*limit of {MAX_CHUNK_BYTES}"):
            check()


# ---- sharded pushes: check_part, then ChunkAssembler ---------------------------------------


@st.composite
def sharded(draw: st.DrawFn) -> tuple[Tensors, list[list[Chunk]]]:
    """Tensors cut into boxes (rows, and columns of matrices), the boxes dealt to 1-3 parts,
    each part's chunks interleaved in an order that keeps every slice's own order."""
    t = draw(tensors())
    n_parts = draw(st.integers(1, 3))
    codec = get_codec(draw(st.sampled_from(["fp32", "fp32+zstd", "int8", "topk2bit+zstd"])))
    streams: list[list[list[Chunk]]] = [[] for _ in range(n_parts)]
    for name, x in sorted(t.items()):
        boxes = [Box.whole(x.shape)]
        if x.dim() >= 1 and x.numel() > 0:
            cols = _cuts(draw, x.shape[1]) if x.dim() >= 2 and draw(st.booleans()) else None
            boxes = grid(tuple(x.shape), _cuts(draw, x.shape[0]), cols)
        for box in boxes:
            piece = x[box.slices()].clone()
            chunks = list(encode_chunks({name: piece}, codec=codec, chunk_bytes=codec.encoded_size(3), boxes={name: (box, tuple(x.shape))}))
            streams[draw(st.integers(0, n_parts - 1))].append(chunks)
    parts = [interleave(s, draw(st.lists(st.integers(0, 7), max_size=10))) for s in streams]
    return t, parts


def grid(full: tuple[int, ...], rows: list[tuple[int, int]], cols: list[tuple[int, int]] | None) -> list[Box]:
    """The boxes of a tensor of shape ``full`` cut at row ranges ``rows`` and, for two or more
    dimensions, column ranges ``cols`` (None: whole rows); later dimensions stay whole."""
    boxes = []
    cols = (cols or [(0, full[1])]) if len(full) > 1 else [None]
    for (r0, r1), c in itertools.product(rows, cols):
        start = (r0, *(() if c is None else (c[0],)), *(0,) * max(len(full) - 2, 0))
        extent = (r1 - r0, *(() if c is None else (c[1] - c[0],)), *full[1 + (c is not None) :])
        boxes.append(Box(start, extent))
    return boxes


def _cuts(draw: st.DrawFn, extent: int) -> list[tuple[int, int]]:
    points = sorted(set(draw(st.lists(st.integers(1, extent - 1), max_size=3)))) if extent > 1 else []
    edges = [0, *points, extent]
    return list(zip(edges, edges[1:]))


def assemble_parts(specs: Mapping[str, TensorSpec], parts: list[list[Chunk]]) -> Tensors:
    checked = [check_part(specs, p)[0] for p in parts]
    asm = ChunkAssembler(specs)
    for kept in checked:
        for chunk, values in kept:
            asm.add(chunk, values)
    return asm.finish()


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=60)
@given(push=sharded())
def test_sharded_parts_reassemble_exactly(push: tuple[Tensors, list[list[Chunk]]]) -> None:
    t, parts = push
    everything = [c for p in parts for c in p]
    want = reference(t, everything)
    assert_same(assemble_parts(fingerprint(t), parts), want)
    assert_same(assemble(fingerprint(t), everything), want)
    if everything and everything[0].codec.startswith("fp32"):
        assert_same(want, t)


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(push=sharded(), part=st.integers(0, 2), at=st.integers(0, 10**6), mutation=st.one_of(HEADER_MUTATION, PAYLOAD_MUTATION))
def test_a_mutated_part_changes_nothing_or_is_refused(push: tuple[Tensors, list[list[Chunk]]], part: int, at: int, mutation: tuple[str, Any]) -> None:
    t, parts = push
    want = reference(t, [c for p in parts for c in p])
    i = part % len(parts)
    if not parts[i]:
        return
    parts = [mutate(p, at, mutation) if j == i else p for j, p in enumerate(parts)]
    got = outcome(lambda: assemble_parts(fingerprint(t), parts), mutation[0])
    if mutation[0] in PAYLOAD_KINDS:
        assert_well_formed(got, t)
    elif not isinstance(got, CodecError):
        assert_same(got, want)


@pytest.mark.timeout(120)
def test_a_slice_pushed_by_two_parts_is_refused() -> None:
    t = {"w": torch.arange(6.0).view(3, 2)}
    box = Box((1, 0), (1, 2))
    chunks = list(encode_chunks({"w": t["w"][box.slices()].clone()}, codec=get_codec("fp32"), boxes={"w": (box, (3, 2))}))
    with pytest.raises(CodecError, match=r"slice \[1:2, 0:2\] starts at element 0, expected 2"):
        assemble_parts(fingerprint(t), [chunks, chunks])


# ---- SliceAssembler (a rank of a sharded site pulling whole tensors) ------------------------


def box_in(shape: tuple[int, ...], seeds: list[int]) -> Box:
    """A non-empty box inside ``shape`` picked by ``seeds`` (1 + 2 per dimension), or the whole
    tensor (when seeds[0] is even, and always when the tensor is empty)."""
    if prod(shape) == 0 or seeds[0] % 2 == 0:
        return Box.whole(shape)
    start = tuple(s % f for s, f in zip(seeds[1::2], shape))
    return Box(start, tuple(1 + s % (f - a) for s, a, f in zip(seeds[2::2], start, shape)))


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=200)
@given(
    t=tensors(),
    codec=codecs(),
    filtered=st.booleans(),
    seeds=st.lists(st.integers(0, 2**16), min_size=21, max_size=21),
    at=st.integers(0, 10**6),
    mutation=st.one_of(HEADER_MUTATION, PAYLOAD_MUTATION),
)
@example(t={"e": torch.zeros(0, 3)}, codec=(get_codec("fp32"), 4), filtered=True, seeds=[0] * 21, at=0, mutation=("drop", None)).via(
    "bug: a wanted slice of an empty tensor never finished"
)
def test_slice_assembler_takes_its_slice_or_refuses(
    t: Tensors, codec: tuple[Any, int], filtered: bool, seeds: list[int], at: int, mutation: tuple[str, Any]
) -> None:
    codec, chunk_bytes = codec
    wanted = {n: box_in(tuple(x.shape), seeds[7 * i : 7 * i + 7]) for i, (n, x) in enumerate(sorted(t.items()))}
    chunks = list(encode_chunks(t, codec=codec, chunk_bytes=chunk_bytes))
    whole = reference(t, chunks)
    want = {n: whole[n][b.slices()] for n, b in wanted.items()}
    if filtered:
        chunks = chunks_overlapping(chunks, wanted)

    def run(cs: list[Chunk]) -> Tensors:
        asm = SliceAssembler(fingerprint(t), wanted)
        for c in cs:
            asm.add(c)
        return asm.finish()

    assert_same(run(chunks), want)
    if not chunks:
        return
    got = outcome(lambda: run(mutate(chunks, at, mutation)), mutation[0])
    if mutation[0] in PAYLOAD_KINDS:
        assert_well_formed(got, want)
    elif not isinstance(got, CodecError):
        assert_same(got, want)


# ---- boxes --------------------------------------------------------------------------------

SMALL_SHAPE = st.lists(st.integers(0, 4), max_size=3).map(tuple)
ANY_BOX = st.builds(Box, DIMS, DIMS)


def _cells(box: Box, full: tuple[int, ...]) -> torch.Tensor:
    mark = torch.zeros(full, dtype=torch.int64)
    mark[box.slices()] += 1
    return mark


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(box=ANY_BOX, full=st.one_of(SMALL_SHAPE, st.lists(EDGE_INT, max_size=4).map(tuple)))  # full: the model's own
@example(box=Box.whole((0, 3)), full=(0, 3)).via("bug: the whole box of an empty tensor was refused")
def test_box_problem_is_none_exactly_for_boxes_inside_the_tensor(box: Box, full: tuple[int, ...]) -> None:
    why = box.problem(full)
    inside = (
        len(box.start) == len(box.shape) == len(full)
        and all(0 <= a and a + n <= f for a, n, f in zip(box.start, box.shape, full))
        and all(n >= 1 or f == 0 for n, f in zip(box.shape, full))  # empty only where the tensor is
    )
    assert (why is None) == inside, why
    if why is not None:
        assert len(why) <= MAX_MESSAGE
    elif max(full, default=0) <= 4:
        assert int(_cells(box, full).sum()) == box.numel
        lo, hi = box.row_window(full)
        assert 0 <= lo <= hi <= prod(full) and hi - lo >= box.numel


@st.composite
def small_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A small shape and up to 4 boxes that may leave it, overlap or leave gaps; half the time
    a tiling made by cutting rows and columns."""
    full = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))
    if draw(st.booleans()) and prod(full) > 0:
        boxes = grid(full, _cuts(draw, full[0]), _cuts(draw, full[1]) if len(full) > 1 else None)
        if draw(st.booleans()):
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        return full, boxes
    box = st.tuples(*[st.integers(-1, f) for f in full]).flatmap(lambda a: st.tuples(st.just(a), st.tuples(*[st.integers(0, 5) for _ in full])))
    return full, [Box(a, n) for a, n in draw(st.lists(box, max_size=4))]


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=300)
@given(case=small_boxes())
def test_tiling_problem_agrees_with_counting_cells(case: tuple[tuple[int, ...], list[Box]]) -> None:
    full, boxes = case
    valid = all(b.problem(full) is None for b in boxes)
    counts = sum((_cells(b, full) for b in boxes), torch.zeros(full, dtype=torch.int64))
    tiles = valid and bool((counts == 1).all())
    assert (tiling_problem(boxes, full) is None) == tiles, tiling_problem(boxes, full)
    if valid:
        for a, b in itertools.combinations(boxes, 2):
            assert a.overlaps(b) == bool((_cells(a, full) * _cells(b, full)).any())
