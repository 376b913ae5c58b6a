"""What the coordinator serves to pullers: the encoded update of each recent round, θ encoded
once per round for sites that (re)join, cut to the slices a rank asks for, and the bytes each
round sent. A whole pull gets the chunks bundled (diloco.wire.bundles: many small tensors in
few messages); a pull of slices gets the plain chunks that hold its rows. Not thread-safe: the
coordinator's lock guards it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from diloco.boxes import Box
from diloco.errors import CoordinatorError
from diloco.types import Chunk, TensorSpec
from diloco.wire import MAX_CHUNK_BYTES, bundle_chunks, chunks_overlapping, inner_payload_bytes


@dataclass(frozen=True)
class _Served:
    chunks: list[Chunk]  # as a whole pull gets them: small ones bundled
    payload_bytes: int  # of the tensors' own payloads (bundle framing excluded)

    @staticmethod
    def of(chunks: list[Chunk], bundle_bytes: int) -> _Served:
        """``chunks`` bundled, every payload then bytes (the encoder may hand views of the
        update's memory: copied here, once)."""
        served = bundle_chunks(chunks, bundle_bytes) if bundle_bytes else list(chunks)
        served = [c if type(c.payload) is bytes else dataclasses.replace(c, payload=bytes(c.payload)) for c in served]
        return _Served(served, sum(len(c.payload) for c in chunks))


# names -> their tensors' chunks (None: every tensor)
Encode = Callable[[Sequence[str] | None], list[Chunk]]


class Downlink:
    def __init__(self, specs: Mapping[str, TensorSpec], keep_updates: int, bundle_bytes: int = MAX_CHUNK_BYTES) -> None:
        """``bundle_bytes``: the most payload one bundle carries (0: no bundles)."""
        self._specs = specs
        self._keep = keep_updates
        self._bundle_bytes = bundle_bytes
        self._updates: dict[int, _Served] = {}
        self._global: tuple[int, _Served] | None = None  # (open round, θ as fp32 chunks)
        self._momentum: tuple[int, _Served] | None = None  # (open round, the outer momentum as fp32 chunks)
        self._bytes: dict[int, int] = {}

    def check_want(self, want: Mapping[str, Box] | None) -> None:
        """Refuses (invalid_argument) slices of unknown tensors or outside their tensor."""
        for name, box in (want or {}).items():
            spec = self._specs.get(name)
            why = f"unknown parameter {name!r}" if spec is None else box.problem(spec.shape)
            if why is not None:
                raise CoordinatorError("invalid_argument", f"pull of slices refused: {why}")

    def prepare(self, chunks: list[Chunk]) -> _Served:
        """An update as it will be served (bundled): touches no state, so the coordinator
        makes it without its lock, while the commit's checkpoint is written."""
        return _Served.of(chunks, self._bundle_bytes)

    def put_update(self, round: int, chunks: list[Chunk] | _Served) -> None:
        """Keeps round ``round``'s encoded update (or what ``prepare`` made of it); forgets
        those ``keep_updates`` rounds older."""
        self._updates[round] = chunks if isinstance(chunks, _Served) else self.prepare(chunks)
        for old in [k for k in self._updates if k <= round - self._keep]:
            del self._updates[old]

    def update(self, round: int, want: Mapping[str, Box] | None) -> list[Chunk]:
        served = self._updates.get(round)
        if served is None:
            raise CoordinatorError("not_found", f"the update of round {round} is no longer kept; pull the global parameters instead")
        return self._serve(round, served, want)

    def global_params(self, open_round: int, encode: Encode, want: Mapping[str, Box] | None) -> list[Chunk]:
        """θ at ``open_round``: encoded once per round (by ``encode``) and shared by every
        puller, so sites joining together do not each hold a copy. A pull of some tensors
        only (the start barrier's smallest one) gets them encoded for it alone: θ whole is
        not encoded and kept for the round for it."""
        if self._some(want):
            assert want is not None
            return self._serve(open_round, _Served.of(encode(sorted(want)), 0), want)
        if self._global is None or self._global[0] != open_round:
            self._global = (open_round, _Served.of(encode(None), self._bundle_bytes))
        return self._serve(open_round, self._global[1], want)

    def outer_state(self, open_round: int, encode: Encode, want: Mapping[str, Box] | None) -> list[Chunk]:
        """The outer optimizer's momentum at ``open_round``, encoded once per round as θ is:
        a site that looks ahead of the outer step asks for it with θ when it (re)joins."""
        if self._some(want):
            assert want is not None
            return self._serve(open_round, _Served.of(encode(sorted(want)), 0), want)
        if self._momentum is None or self._momentum[0] != open_round:
            self._momentum = (open_round, _Served.of(encode(None), self._bundle_bytes))
        return self._serve(open_round, self._momentum[1], want)

    def _some(self, want: Mapping[str, Box] | None) -> bool:
        """``want`` names some of the tensors, not every one (a multi-rank site's ranks want
        slices of every tensor: they share the round's encoding)."""
        return want is not None and len(want) < len(self._specs)

    def _serve(self, round: int, served: _Served, want: Mapping[str, Box] | None) -> list[Chunk]:
        if want is None:
            chunks, payload = served.chunks, served.payload_bytes
        else:
            chunks = chunks_overlapping(served.chunks, want)  # plain chunks, out of the bundles
            payload = inner_payload_bytes(chunks)
        self._bytes[round] = self._bytes.get(round, 0) + payload
        return chunks

    def bytes_sent(self, round: int) -> int:
        return self._bytes.get(round, 0)

    def clear(self) -> None:
        """After a restart: the updates of the predecessor are gone (sites then pull θ)."""
        self._updates, self._global, self._momentum = {}, None, None
