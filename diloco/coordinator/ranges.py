"""The cut of a model's parameters into the ranges a coordinator's shards own.

A range is a run of whole tensors in name order (the order of θ's hash and of the update's
chunks, so that the shards' parts put one after the other are the whole model's), balanced by
elements: each cut falls at the tensor boundary nearest to an equal share.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence


def split_ranges(shapes: Mapping[str, Sequence[int]], shards: int) -> tuple[tuple[str, ...], ...]:
    """``shards`` ranges of the tensors of ``shapes`` (name -> shape), every name in one of
    them, each non-empty. ValueError naming ``coordinator.shards`` when it is not an integer
    from 1 to the number of tensors."""
    names = sorted(shapes)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= max(len(names), 1):
        raise ValueError(f"coordinator.shards={shards!r}: must be an integer from 1 to the model's number of tensors ({len(names)})")
    sizes = [math.prod(shapes[n]) for n in names]
    ends = []  # ends[i]: elements in names[: i + 1]
    total = 0
    for size in sizes:
        total += size
        ends.append(total)
    cuts = [0]
    for k in range(1, shards):
        target = total * k / shards
        # the cut after tensor i (names[: i + 1] before it), nearest to the target; at least
        # one tensor since the last cut, and one left for each range still to come
        lo, hi = cuts[-1] + 1, len(names) - (shards - k)
        i = min(max(bisect.bisect_left(ends, target), lo - 1), hi - 1)
        candidates = [j for j in (i, i + 1) if lo <= j + 1 <= hi]
        best = min(candidates, key=lambda j: (abs(ends[j] - target), j))
        cuts.append(best + 1)
    cuts.append(len(names))
    return tuple(tuple(names[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))
