"""Connection striping: one site's push or pull spread over several concurrent streams, each on
its own TCP connection, so a link whose bandwidth-delay product one stream cannot fill is
filled (PCCL stripes its transfers over many connections for the same reason).

A push is cut into ``k`` parts, the sharded-site machinery the coordinator already has: each
part holds whole tensors or row ranges of one (boxes), the parts together tile every tensor
exactly, and the push counts once the last part is in. A pull asks each stream for a share of
the tensors (rows of the large ones) and stitches the slices back together. Which rows go on
which stream depends only on the shapes and ``k``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from diloco.boxes import Box
from diloco.codec import Codec
from diloco.types import Chunk, PushHeader, TensorSpec
from diloco.wire import SliceAssembler, encode_chunks


def stripe_boxes(held: Mapping[str, Box], shapes: Mapping[str, tuple[int, ...]], k: int, split_rows: bool = True) -> list[dict[str, Box]]:
    """``held`` (name -> the slice this rank syncs) spread over exactly ``k`` stripes of about
    equal elements (some may be empty): the largest piece first, each to the emptiest stripe
    that holds nothing of its tensor yet; with ``split_rows``, a whole tensor larger than a
    stripe's share is first cut into at most ``k`` row ranges. A stripe holds at most one slice
    of a tensor, so it is one part of a push (or one pull) like a rank's."""
    if k <= 1:
        return [dict(held)]
    share = max(1, -(-sum(b.numel for b in held.values()) // k))
    pieces: list[tuple[str, Box]] = []
    for name, box in held.items():
        shape = shapes[name]
        if split_rows and box.is_whole(shape) and box.numel > share and len(shape) >= 1 and shape[0] > 1:
            n_pieces = min(k, shape[0], -(-box.numel // share))
            rows = -(-shape[0] // n_pieces)
            for a in range(0, shape[0], rows):
                pieces.append((name, Box((a, *([0] * (len(shape) - 1))), (min(rows, shape[0] - a), *shape[1:]))))
        else:
            pieces.append((name, box))
    stripes: list[dict[str, Box]] = [{} for _ in range(k)]
    size = [0] * k
    for name, box in sorted(pieces, key=lambda nb: (-nb[1].numel, nb[0], nb[1].start)):
        i = min((j for j in range(k) if name not in stripes[j]), key=lambda j: (size[j], j))
        stripes[i][name] = box
        size[i] += box.numel
    return stripes


def box_values(values: torch.Tensor, held: Box, box: Box) -> torch.Tensor:
    """The elements of ``box`` (in the whole tensor's coordinates) out of ``values``, which hold
    the slice ``held``: contiguous, for the encoder."""
    rel = tuple(slice(a - h, a - h + n) for a, h, n in zip(box.start, held.start, box.shape))
    return values[rel].contiguous()


class StripedPull:
    """Assembles the slices pulled over several streams into what one stream would have given:
    whole tensors (``whole``) or this rank's slices (``held``)."""

    def __init__(self, specs: Mapping[str, TensorSpec], stripes: list[dict[str, Box]], held: Mapping[str, Box]) -> None:
        self._specs, self._held = specs, dict(held)
        self.parts = [SliceAssembler(specs, s) for s in stripes]
        self._stripes = stripes

    @property
    def payload_bytes(self) -> int:
        return sum(a.payload_bytes for a in self.parts)

    def finish(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for stripe, part in zip(self._stripes, self.parts):
            got = part.finish()
            for name, box in stripe.items():
                held = self._held[name]
                if box == held:
                    out[name] = got[name]
                    continue
                buf = out.get(name)
                if buf is None:
                    buf = out[name] = torch.empty(held.shape, dtype=torch.float32)
                rel = tuple(slice(a - h, a - h + n) for a, h, n in zip(box.start, held.start, box.shape))
                buf[rel] = got[name]
        return out


def encode_parts(
    header: PushHeader, delta: Mapping[str, torch.Tensor], held: Mapping[str, Box], specs: Mapping[str, TensorSpec], codec: Codec, chunk_bytes: int,
    streams: int, split_rows: bool,
) -> list[tuple[PushHeader, list[Chunk]]]:  # fmt: skip
    """A push as one part per stream: Δ's slices (``held``: the boxes this rank pushes) striped
    over ``streams`` parts, numbered after the site's ranks' own (rank × k + i of world × k),
    each encoded on its own; one part, the header's own, for one stream."""
    shapes = {n: specs[n].shape for n in held}
    if streams == 1:
        boxes = {n: (held[n], shapes[n]) for n in held}
        return [(header, list(encode_chunks(delta, codec=codec, chunk_bytes=chunk_bytes, boxes=boxes)))]
    parts = []
    for i, stripe in enumerate(stripe_boxes(held, shapes, streams, split_rows=split_rows)):
        values = {n: box_values(delta[n], held[n], b) for n, b in stripe.items()}
        chunks = list(encode_chunks(values, codec=codec, chunk_bytes=chunk_bytes, boxes={n: (b, shapes[n]) for n, b in stripe.items()}))
        part = dataclasses.replace(header, part=header.part * streams + i, parts=header.parts * streams, eval=header.eval if i == 0 else None)
        parts.append((part, chunks))
    return parts
