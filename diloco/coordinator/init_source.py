"""init=site: which joining site sends θ₀ when the coordinator starts without a model.

At most one site is the source at a time. It keeps the role while its upload is under way;
a source that fails its upload, or does not start it within ``timeout_s`` of being chosen (it
crashed, or lost its connection), loses the role and the next site that can upload takes it.
Not thread-safe on its own: the coordinator calls it under its lock. The clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

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
        self.uploading = False
        self._chosen_at = 0.0
        self.refused: list[str] = []  # why earlier sources' uploads were refused (for the log)

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
        self.source, self.specs, self.uploading, self._chosen_at = site_id, specs, False, self._clock()
        return True

    def start(self, site_id: str) -> str | None:
        """The source begins its upload; the reason it may not, or None."""
        if self.source != site_id:
            held = f"site {self.source!r} was chosen" if self.source is not None else "no site was chosen (join first)"
            return f"site {site_id!r} is not the source of θ₀: {held}"
        if self.uploading:
            return f"site {site_id!r} is already uploading θ₀"
        self.uploading = True
        return None

    def release(self, site_id: str, why: str) -> None:
        """The source's upload failed: the role goes to the next site that can upload."""
        if self.source == site_id:
            self.source, self.specs, self.uploading = None, {}, False
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


def decode_upload(specs: Mapping[str, TensorSpec], chunks: Iterable[Chunk], keep_alive: Callable[[], None]) -> tuple[dict[str, torch.Tensor], int]:
    """The uploaded θ₀ (every declared tensor, whole, lossless, finite) and its payload bytes;
    CodecError naming what was wrong. ``keep_alive`` is called every KEEP_ALIVE_EVERY chunks
    (an upload may outlast the source's lease)."""
    assembler = ChunkAssembler(specs)
    for i, chunk in enumerate(unbundled(chunks)):
        if i % KEEP_ALIVE_EVERY == KEEP_ALIVE_EVERY - 1:
            keep_alive()
        if not is_lossless(chunk.codec):
            raise CodecError(f"chunk of {chunk.name!r} is encoded with {quote(chunk.codec, 80)}; θ₀ must be sent lossless (fp32)")
        if chunk.box_shape or chunk.box_start:
            raise CodecError(f"chunk of {chunk.name!r} holds a slice; θ₀ is sent whole, from a one-rank site")
        assembler.add(chunk)
    return assembler.finish(), assembler.payload_bytes
