"""Streaming DiLoCo's fragments: the parameters split into F parts, one synced per round.

Round r syncs fragment r mod F, so a site's fragment p syncs every F rounds (H inner steps)
at offset (p + 1)·H/F, and only 1/F of the model is in flight at a time (arXiv 2501.18512).
The split is strided over the layers, which the paper found best: layer i (the i-th distinct
layer index in the names, in numeric order) goes to fragment i mod F. Tensors outside the
layers (embeddings, the final norm, a head) go, largest first, to the fragment with the
fewest elements so far, so the fragments stay close in size. The split is a function of the
names and shapes alone, so the coordinator and every site compute the same one without
being told, and a run records it (``describe``).

``sync.split=balanced`` instead gives each fragment the same number of elements, as far as
whole tensors allow: every tensor, largest first, goes to the fragment with the fewest
elements so far (longest-processing-time), so each fragment holds tensors of most layers. A
model whose layers do not divide into F equal groups (8 layers in 5 fragments: three of
1.58M elements, two of 0.8M) otherwise sends fragments whose sizes differ by up to 2x, and the
largest fragment's sync is what overlap must hide (docs/streaming.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the first dotted component that is a number: blocks.3.attn.q.weight -> 3


def layer_of(name: str) -> int | None:
    """The layer index a parameter name carries (``blocks.3.…``, ``model.layers.12.…``), if any."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


SPLITS = ("strided", "balanced")


def check_split(how: object) -> str | None:
    """Why ``how`` (sync.split) is not a split this module knows, or None."""
    return None if how in SPLITS else f"sync.split={how!r}: must be one of {', '.join(SPLITS)}"


def split_fragments(shapes: Mapping[str, Sequence[int]], fragments: int, how: str = "strided") -> tuple[tuple[str, ...], ...]:
    """F tuples of parameter names (each sorted), together every name once. ValueError naming
    ``fragments`` when F is not a positive integer or exceeds the model's layers (``strided``)
    or tensors (``balanced``), and naming ``sync.split`` for an unknown ``how``."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"sync.fragments={fragments!r}: must be an integer >= 1")
    why = check_split(how)
    if why is not None:
        raise ValueError(why)
    names = sorted(shapes)
    if fragments == 1:
        return (tuple(names),)
    if how == "balanced":
        return _balanced(shapes, names, fragments)
    layers = sorted({i for i in (layer_of(n) for n in names) if i is not None})
    if len(layers) < fragments:
        raise ValueError(
            f"sync.fragments={fragments}: the model has only {len(layers)} layer(s) (numbered parameter names), so at most sync.fragments={max(len(layers), 1)}"
        )
    slot = {layer: k % fragments for k, layer in enumerate(layers)}
    parts: list[list[str]] = [[] for _ in range(fragments)]
    size = [0] * fragments
    rest = []
    for n in names:
        layer = layer_of(n)
        if layer is None:
            rest.append(n)
            continue
        parts[slot[layer]].append(n)
        size[slot[layer]] += _numel(shapes[n])
    for n in sorted(rest, key=lambda n: (-_numel(shapes[n]), n)):
        p = min(range(fragments), key=lambda i: (size[i], i))
        parts[p].append(n)
        size[p] += _numel(shapes[n])
    return tuple(tuple(sorted(p)) for p in parts)


def _balanced(shapes: Mapping[str, Sequence[int]], names: list[str], fragments: int) -> tuple[tuple[str, ...], ...]:
    """Largest tensor first (ties in the model's layer order), each to the smallest fragment."""
    if len(names) < fragments:
        raise ValueError(f"sync.fragments={fragments}: the model has only {len(names)} tensor(s), so at most sync.fragments={max(len(names), 1)}")
    parts: list[list[str]] = [[] for _ in range(fragments)]
    size = [0] * fragments
    for n in sorted(names, key=lambda n: (-_numel(shapes[n]), _layer_or_first(n), n)):
        p = min(range(fragments), key=lambda i: (size[i], i))
        parts[p].append(n)
        size[p] += _numel(shapes[n])
    return tuple(tuple(sorted(p)) for p in parts)


def fragment_of_round(round: int, fragments: int) -> int:
    """The fragment round ``round`` syncs."""
    return round % fragments


def describe(split: Sequence[Sequence[str]], shapes: Mapping[str, Sequence[int]]) -> list[dict[str, object]]:
    """The split as a run records it: per fragment its tensors' names and element count."""
    return [{"fragment": i, "numel": sum(_numel(shapes[n]) for n in part), "names": list(part)} for i, part in enumerate(split)]


def _layer_or_first(name: str) -> int:
    layer = layer_of(name)
    return -1 if layer is None else layer


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
