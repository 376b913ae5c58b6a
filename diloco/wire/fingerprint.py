"""Model fingerprints: the names, shapes and dtypes a site and the coordinator must share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from diloco.types import TensorSpec
from diloco.wire.chunks import dtype_name


def fingerprint(params: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in sorted(params.items())}


def mismatches(expected: Mapping[str, TensorSpec], got: Iterable[TensorSpec], limit: int = 5) -> list[str]:
    """Human-readable differences between two fingerprints, at most ``limit`` of them."""
    got_by_name = {s.name: s for s in got}
    out = []
    for name in sorted(set(expected) | set(got_by_name)):
        e, g = expected.get(name), got_by_name.get(name)
        if e is None:
            out.append(f"unexpected parameter {name!r}")
        elif g is None:
            out.append(f"missing parameter {name!r}")
        elif tuple(g.shape) != e.shape or g.dtype != e.dtype:
            out.append(f"{name!r}: coordinator has {list(e.shape)} {e.dtype}, site has {list(g.shape)} {g.dtype}")
        if len(out) >= limit:
            break
    return out
