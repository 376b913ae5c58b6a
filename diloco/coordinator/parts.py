"""Pushes of sharded sites: every rank pushes its own slices as one part; the site's push
counts once all its parts have arrived. Parts wait here (decoded, as checked on arrival) until then."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.boxes import Box
from diloco.types import Chunk, PushHeader


@dataclass
class _Pending:
    parts: int
    tokens: int
    headers: dict[int, PushHeader] = field(default_factory=dict)
    chunks: dict[int, list[tuple[Chunk, torch.Tensor]]] = field(default_factory=dict)  # part -> its chunks with their values
    payload: dict[int, int] = field(default_factory=dict)  # part -> its payload bytes
    boxes: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)  # name -> (slice, part)


class PartialPushes:
    """Parts of sharded pushes by (site, round). Not thread-safe: the coordinator's lock guards it."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], _Pending] = {}

    def add(
        self, header: PushHeader, chunks: list[tuple[Chunk, torch.Tensor]], boxes: dict[str, list[Box]], payload: int
    ) -> tuple[str, dict[int, list[tuple[Chunk, torch.Tensor]]], dict[int, int]]:
        """("waiting", {}, {}), ("duplicate", {}, {}) for a part already here, or ("complete",
        part -> its chunks with their values, part -> its payload bytes) when this was the last one. ValueError when the part disagrees with the
        parts before it (their number, the tokens) or one of its slices overlaps theirs."""
        key = (header.site_id, header.round)
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(parts=header.parts, tokens=header.tokens)
        if header.part in p.headers:
            return "duplicate", {}, {}
        if header.parts != p.parts or header.tokens != p.tokens:
            raise ValueError(
                f"part {header.part} says parts={header.parts}, tokens={header.tokens}; the parts before it said parts={p.parts}, tokens={p.tokens}"
            )
        for name, mine in boxes.items():
            for box in mine:
                for other, part in p.boxes.get(name, []):
                    if other.overlaps(box):
                        raise ValueError(f"slice {box} of {name!r} (part {header.part}) overlaps slice {other} of part {part}")
        p.headers[header.part] = header
        p.chunks[header.part] = chunks
        p.payload[header.part] = payload
        for name, mine in boxes.items():
            p.boxes.setdefault(name, []).extend((b, header.part) for b in mine)
        if len(p.headers) < p.parts:
            return "waiting", {}, {}
        del self._pending[key]
        return "complete", dict(sorted(p.chunks.items())), p.payload

    def discard(self, site_id: str, round: int) -> None:
        self._pending.pop((site_id, round), None)

    def discard_site(self, site_id: str) -> None:
        for key in [k for k in self._pending if k[0] == site_id]:
            del self._pending[key]

    def prune(self, keep: Callable[[int], bool]) -> None:
        """Forgets the parts of rounds that can no longer be taken."""
        for key in [k for k in self._pending if not keep(k[1])]:
            del self._pending[key]

    def clear(self) -> None:
        self._pending.clear()
