"""Who syncs what on a multi-rank site, from what each rank holds (diloco.site.layouts.found.plan):
pure, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco.boxes import Box
from diloco.site.layouts.found import LayoutError, _Piece, check_agreement, plan, unwrap


def whole(*shape: int) -> _Piece:
    return _Piece(shape, "float32", Box.whole(shape))


def rows(lo: int, n: int, *shape: int) -> _Piece:
    return _Piece(shape, "float32", Box((lo, *(0 for _ in shape[1:])), (n, *shape[1:])))


def test_replicas_share_the_pushing_largest_first_and_every_box_once() -> None:
    every = {"a": whole(100, 10), "b": whole(60, 10), "c": whole(50, 10), "d": whole(5)}
    p = plan([every, every])  # DDP: both ranks hold everything
    assert p.owner == {("a", Box.whole((100, 10))): 0, ("b", Box.whole((60, 10))): 1, ("c", Box.whole((50, 10))): 1, ("d", Box.whole((5,))): 0}
    assert all(h == (0, 1) for h in p.holders.values())
    assert sorted(p.specs) == ["a", "b", "c", "d"]


def test_shards_are_their_own_ranks_and_stages_unite() -> None:
    p = plan([{"w": rows(0, 2, 4, 3), "x": whole(2)}, {"w": rows(2, 2, 4, 3), "y": whole(7)}])
    assert p.owner == {("w", Box((0, 0), (2, 3))): 0, ("w", Box((2, 0), (2, 3))): 1, ("x", Box.whole((2,))): 0, ("y", Box.whole((7,))): 1}
    assert [s.shape for s in p.specs.values()] == [(4, 3), (2,), (7,)]


def test_an_empty_box_of_a_small_tensor_is_no_gap() -> None:
    # FSDP2 of a one-row tensor on 2 ranks: rank 1's box of it is empty
    p = plan([{"b": rows(0, 1, 1), "w": rows(0, 2, 4)}, {"b": _Piece((1,), "float32", Box((1,), (0,))), "w": rows(2, 2, 4)}])
    assert p.owner == {("b", Box((0,), (1,))): 0, ("w", Box((0,), (2,))): 0, ("w", Box((2,), (2,))): 1}


@pytest.mark.parametrize(
    ("pieces", "says"),
    [
        ([{"w": rows(0, 3, 4, 3)}, {"w": rows(2, 2, 4, 3)}], "slices [0:3, 0:3] and [2:4, 0:3] overlap ([0:3, 0:3] on rank 0; [2:4, 0:3] on rank 1)"),
        ([{"w": rows(0, 2, 4, 3)}, {}], "cover 6 of 12 elements (a gap) ([0:2, 0:3] on rank 0)"),
        ([{"w": whole(4, 3)}, {"w": whole(4, 2)}], "the ranks disagree on parameter 'w' (rank 0: [4, 3] float32; rank 1: [4, 2] float32)"),
        ([{"w": whole(4)}, {"w": _Piece((4,), "bfloat16", Box.whole((4,)))}], "rank 1: [4] bfloat16"),
    ],
)
def test_what_does_not_make_one_model_is_named(pieces: list, says: str) -> None:
    with pytest.raises(LayoutError) as e:
        plan(pieces)
    assert says in str(e.value)


def test_every_rank_pushes_something_or_is_named() -> None:
    every = {"a": whole(100), "b": whole(1), "c": whole(1)}
    p = plan([every, every, every])  # largest first gives rank 0 "a", rank 1 "b" and "c": rank 2 takes one
    assert sorted(p.owner.values()) == [0, 1, 2]
    with pytest.raises(LayoutError, match="rank 2 of the site would push nothing: the site's 3 ranks hold 2 distinct slices"):
        plan([{"a": whole(4), "b": whole(3)}] * 3)


def test_ranks_given_other_arguments_are_named() -> None:
    check_agreement([{"site_id": "a", "sync_every": 4}] * 3)
    with pytest.raises(LayoutError, match=r"different site_id \(ranks 0, 2: 'a'; rank 1: 'b'\)"):
        check_agreement([{"site_id": "a"}, {"site_id": "b"}, {"site_id": "a"}])


def test_wrappers_that_only_rename_are_seen_through() -> None:
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)  # not run: wrapping costs nothing
    assert unwrap(compiled) is model
    assert unwrap(nn.DataParallel(compiled)) is model
