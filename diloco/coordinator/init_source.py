"""init=site: which joining site sends θ₀ when the coordinator starts without a model.

At most one site is the source at a time. It keeps the role while its upload is under way;
a source that fails its upload, or does not start it within ``timeout_s`` of being chosen (it
crashed, or lost its connection), loses the role and the next site that can upload takes it.
Not thread-safe on its own: the coordinator calls it under its lock. The clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from diloco.codec import CodecError, is_lossless
from diloco.security.ids import quote
from diloco.types import Chunk, TensorSpec
from diloco.wire import ChunkAssembler, unbundled

KEEP_ALIVE_EVERY = 64  # chunks (of <= 1 MiB) between lease renewals while θ₀ is uploaded


class InitElection:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.timeout_s = timeout_s
        self._clock = clock
        self.source: str | None = None  # the site chosen to upload θ₀
        self.specs: dict[str, TensorSpec] = {}  # the fingerprint it declared when it joined
        self.in_flight = 0  # its uploads under way (the ranks of a multi-rank source send one part each)
        self._chosen_at = 0.0
        self.refused: list[str] = []  # why earlier sources' uploads were refused (for the log)

    @property
    def uploading(self) -> bool:
        return self.in_flight > 0

    def free(self) -> bool:
        """No site holds the role (nobody was chosen, or the last source gave it up or timed out)."""
        if self.source is not None and not self.uploading and self._clock() - self._chosen_at > self.timeout_s:
            self.source = None
        return self.source is None

    def choose(self, site_id: str, specs: dict[str, TensorSpec]) -> bool:
        """Makes ``site_id`` the source if the role is free (or already its: a repeated Join)."""
        if self.source == site_id and not self.uploading:
            self._chosen_at = self._clock()
            self.specs = specs
            return True
        if not self.free():
            return False
        self.source, self.specs, self.in_flight, self._chosen_at = site_id, specs, 0, self._clock()
        return True

    def start(self, site_id: str, part: bool = False) -> str | None:
        """The source begins an upload (``part``: one rank's part of it, which may run beside
        the other ranks'); the reason it may not, or None."""
        if self.source != site_id:
            held = f"site {self.source!r} was chosen" if self.source is not None else "no site was chosen (join first)"
            return f"site {site_id!r} is not the source of θ₀: {held}"
        if self.uploading and not part:
            return f"site {site_id!r} is already uploading θ₀"
        self.in_flight += 1
        return None

    def part_done(self, site_id: str) -> None:
        """One part arrived whole; the source keeps the role for ``timeout_s`` more while none is
        under way (a rank that died before sending its part does not hold it for ever)."""
        if self.source == site_id and self.in_flight > 0:
            self.in_flight -= 1
            self._chosen_at = self._clock()

    def release(self, site_id: str, why: str) -> None:
        """The source's upload failed: the role goes to the next site that can upload."""
        if self.source == site_id:
            self.source, self.specs, self.in_flight = None, {}, 0
            self.refused.append(why)


def upload_problem(declared: Mapping[str, TensorSpec], count: int) -> str | None:
    """Why a fingerprint cannot become θ₀'s, or None: θ is kept and averaged in float32."""
    if not declared:
        return "its model has no parameters"
    if len(declared) != count:
        return "its fingerprint names a parameter twice"
    for spec in declared.values():
        if not spec.name:
            return "a parameter has an empty name"
        if spec.dtype != "float32":
            return f"parameter {quote(spec.name, 80)} is {quote(spec.dtype, 80)}; θ is kept in float32 (keep the parameters float32 and train in bf16 with autocast)"
    return None


def checked_upload(chunks: Iterable[Chunk], keep_alive: Callable[[], None], sliced: bool) -> Iterator[Chunk]:
    """The chunks of an upload of θ₀, each lossless (and whole unless ``sliced``: a part from a
    multi-rank site); ``keep_alive`` called every KEEP_ALIVE_EVERY chunks (an upload may outlast
    the source's lease). CodecError naming the chunk otherwise."""
    for i, chunk in enumerate(unbundled(chunks)):
        if i % KEEP_ALIVE_EVERY == KEEP_ALIVE_EVERY - 1:
            keep_alive()
        if not is_lossless(chunk.codec):
            raise CodecError(f"chunk of {chunk.name!r} is encoded with {quote(chunk.codec, 80)}; θ₀ must be sent lossless (fp32)")
        if not sliced and (chunk.box_shape or chunk.box_start):
            raise CodecError(f"chunk of {chunk.name!r} holds a slice; θ₀ is sent whole from a one-rank site, as parts from a multi-rank one")
        yield chunk


def decode_upload(specs: Mapping[str, TensorSpec], chunks: Iterable[Chunk], keep_alive: Callable[[], None]) -> tuple[dict[str, torch.Tensor], int]:
    """The uploaded θ₀ (every declared tensor, whole, lossless, finite) and its payload bytes;
    CodecError naming what was wrong. ``keep_alive`` is called every KEEP_ALIVE_EVERY chunks
    (an upload may outlast the source's lease)."""
    assembler = ChunkAssembler(specs)
    for chunk in checked_upload(chunks, keep_alive, sliced=False):
        assembler.add(chunk)
    return assembler.finish(), assembler.payload_bytes


class InitParts:
    """The parts of θ₀ from a multi-rank source, one per rank, each checked as it arrived
    (``check_part``) and put in place here; whole once every part is in and they tile every
    tensor. Under the coordinator's lock."""

    def __init__(self, site_id: str, parts: int, specs: Mapping[str, TensorSpec]) -> None:
        self.site_id, self.parts = site_id, parts
        self.assembler = ChunkAssembler(specs)
        self.got: set[int] = set()
        self.payload_bytes = 0

    def problem(self, site_id: str, part: int, parts: int) -> str | None:
        if site_id != self.site_id:
            return f"site {site_id!r} is not the source of θ₀ (site {self.site_id!r} is sending it)"
        if parts != self.parts:
            return f"part {part} says parts={parts}; the parts before it said {self.parts}"
        if part in self.got:
            return f"part {part} of θ₀ from site {site_id!r} arrived already"
        return None

    def add(self, part: int, kept: Iterable[tuple[Chunk, torch.Tensor]], payload: int) -> dict[str, torch.Tensor] | None:
        """Puts one part in place (CodecError for a slice overlapping another part's); θ₀ whole
        when this was the last part (CodecError for a gap), else None."""
        for chunk, values in kept:
            self.assembler.add(chunk, values)
        self.got.add(part)
        self.payload_bytes += payload
        return self.assembler.finish() if len(self.got) == self.parts else None
