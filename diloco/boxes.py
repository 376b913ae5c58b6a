"""Slices of a tensor that one rank of a sharded site holds: boxes (a first index and an
extent per dimension). Pure Python: what overlaps, what tiles, which flat range holds a box."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Box:
    """Elements ``start[d] .. start[d] + shape[d] - 1`` along every dimension d."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape))

    def is_whole(self, full: Sequence[int]) -> bool:
        return self.start == tuple(0 for _ in full) and self.shape == tuple(full)

    def problem(self, full: Sequence[int]) -> str | None:
        """Why this box is not a box inside a tensor of shape ``full``, non-empty unless the
        tensor is empty (None: it is)."""
        if len(self.start) != len(full) or len(self.shape) != len(full):
            # Not the box itself: its dimensions come from the network, unbounded in number.
            return f"a box of {len(self.start)}/{len(self.shape)} dimensions (start/shape) for a tensor of {len(full)}"
        for d, (a, n, f) in enumerate(zip(self.start, self.shape, full)):
            # An extent of 0 only where the tensor has one: the whole box of an empty tensor.
            if a < 0 or n < 0 or (n == 0 and f > 0) or a + n > f:
                return f"box {self} leaves the tensor of shape {list(full)} in dimension {d}"
        return None

    def overlaps(self, other: Box) -> bool:
        return all(a < b + m and b < a + n for a, n, b, m in zip(self.start, self.shape, other.start, other.shape))

    def row_window(self, full: Sequence[int]) -> tuple[int, int]:
        """The flat element range [lo, hi) of the dimension-0 rows this box touches: where its
        elements lie in the tensor's flattened view (exactly the box when it spans whole rows)."""
        if not full:
            return 0, 1
        row = prod(full[1:])
        return self.start[0] * row, (self.start[0] + self.shape[0]) * row

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(self.start, self.shape)) + "]"


def tiling_problem(boxes: Sequence[Box], full: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile a tensor of shape ``full`` exactly (None: they do)."""
    for b in boxes:
        why = b.problem(full)
        if why:
            return why
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.overlaps(b):
                return f"slices {a} and {b} overlap"
    covered = sum(b.numel for b in boxes)
    if covered != prod(full):
        return f"slices {', '.join(str(b) for b in boxes)} cover {covered} of {prod(full)} elements (a gap)"
    return None
