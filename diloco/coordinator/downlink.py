"""What the coordinator serves to pullers: the encoded update of each recent round, θ encoded
once per round for sites that (re)join, cut to the slices a rank asks for, and the bytes each
round sent. Not thread-safe: the coordinator's lock guards it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from diloco.boxes import Box
from diloco.wire import chunks_overlapping
from diloco.errors import CoordinatorError
from diloco.types import Chunk, TensorSpec


class Downlink:
    def __init__(self, specs: Mapping[str, TensorSpec], keep_updates: int) -> None:
        self._specs = specs
        self._keep = keep_updates
        self._updates: dict[int, list[Chunk]] = {}
        self._global: tuple[int, list[Chunk]] | None = None  # (open round, θ as fp32 chunks)
        self._bytes: dict[int, int] = {}

    def check_want(self, want: Mapping[str, Box] | None) -> None:
        """Refuses (invalid_argument) slices of unknown tensors or outside their tensor."""
        for name, box in (want or {}).items():
            spec = self._specs.get(name)
            why = f"unknown parameter {name!r}" if spec is None else box.problem(spec.shape)
            if why is not None:
                raise CoordinatorError("invalid_argument", f"pull of slices refused: {why}")

    def put_update(self, round: int, chunks: list[Chunk]) -> None:
        """Keeps round ``round``'s encoded update; forgets those ``keep_updates`` rounds older."""
        self._updates[round] = chunks
        for old in [k for k in self._updates if k <= round - self._keep]:
            del self._updates[old]

    def update(self, round: int, want: Mapping[str, Box] | None) -> list[Chunk]:
        chunks = self._updates.get(round)
        if chunks is None:
            raise CoordinatorError("not_found", f"the update of round {round} is no longer kept; pull the global parameters instead")
        return self._serve(round, chunks, want)

    def global_params(self, open_round: int, encode: Callable[[], list[Chunk]], want: Mapping[str, Box] | None) -> list[Chunk]:
        """θ at ``open_round``: encoded once per round (by ``encode``) and shared by every
        puller, so sites joining together do not each hold a copy."""
        if self._global is None or self._global[0] != open_round:
            self._global = (open_round, encode())
        return self._serve(open_round, self._global[1], want)

    def _serve(self, round: int, chunks: list[Chunk], want: Mapping[str, Box] | None) -> list[Chunk]:
        if want is not None:
            chunks = chunks_overlapping(chunks, want)
        self._bytes[round] = self._bytes.get(round, 0) + sum(len(c.payload) for c in chunks)
        return chunks

    def bytes_sent(self, round: int) -> int:
        return self._bytes.get(round, 0)

    def clear(self) -> None:
        """After a restart: the updates of the predecessor are gone (sites then pull θ)."""
        self._updates, self._global = {}, None
