"""The codec interface and the registry of codecs by name."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from diloco.security.ids import quote

try:  # the compiled loops (setup.py; optional): the fused intake's fp32 check and sum
    from diloco.codec import _int8_native as _native
except ImportError:
    _native = None


class CodecError(ValueError):
    """A payload that cannot be decoded as declared; the message says what disagrees."""


class Codec(Protocol):
    """Encodes a 1-D float32 tensor slice to bytes and decodes it back.

    ``decode(encode(x), x.numel())`` returns a new float32 tensor of the same numel; lossy
    codecs return an approximation. ``max_chunk_numel(n_bytes)`` is the most elements whose
    encoding is guaranteed to fit in n_bytes, so chunks stay under the transport's limit.
    ``encoded_size(numel)`` is the payload size this codec produces for numel elements
    (exact, or an upper bound for entropy coders); ``max_encoded_size(numel)`` bounds the
    payload of a valid encoding of numel elements under *any* parameters a sender may have
    used (block size, density), which is what a decoder may allocate at most.
    Codecs are stateless and deterministic; error feedback is the caller's job. A codec whose
    payload can be cut without re-encoding also has ``slice_payload(payload, numel, start,
    stop)`` (the coordinator then sends a rank of a sharded site only the elements it holds).
    A decoder raises CodecError, never another exception, for a payload that does not
    match numel; an encoder raises CodecError for input it cannot represent. A codec may also
    have ``decode_into(payload, numel, out)``, which writes ``decode``'s values into a
    contiguous float32 tensor ``out`` of numel elements (receivers then skip a temporary).
    A codec may also have the fused intake's pair (diloco/wire/held.py):
    ``check_payload(payload, numel)``, which raises CodecError wherever ``decode`` would or a
    decoded value would not be finite, without decoding, and ``accumulate(payload, numel, out,
    alpha)``, which adds ``alpha`` times ``decode``'s values, widened to float64, into the
    contiguous float64 tensor ``out`` (the same sum for every order of calls that float64
    addition gives; no float32 copy in between).
    """

    name: str

    def encode(self, flat: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes, numel: int) -> torch.Tensor: ...

    def max_chunk_numel(self, chunk_bytes: int) -> int: ...

    def encoded_size(self, numel: int) -> int: ...

    def max_encoded_size(self, numel: int) -> int: ...


def check_out(out: torch.Tensor, numel: int) -> None:
    """``decode_into``'s check of the tensor it writes: contiguous float32 of ``numel`` elements."""
    if out.numel() != numel or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"decode_into needs a contiguous float32 tensor of {numel} elements, got {out.dtype} {list(out.shape)}")


class Fp32Codec:
    """Raw little-endian float32: the lossless reference. No header: 4 * numel bytes.

    Non-finite values pass through unchanged (the receiver's assembler rejects them).
    """

    name = "fp32"
    byte_planes = (0, 4)  # for the zstd stage: no header, 4-byte elements

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def max_encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, flat: torch.Tensor) -> bytes:
        return flat.detach().to(torch.float32).contiguous().numpy().tobytes()

    def encode_view(self, flat: torch.Tensor) -> memoryview:
        """``encode``'s bytes without copying them: a view of ``flat``'s memory (a copy only
        when it is not already contiguous float32 on the CPU). Valid, and equal to
        ``encode(flat)``, for as long as ``flat`` is not written to."""
        return memoryview(flat.detach().to(torch.float32).contiguous().numpy()).cast("B")

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        if len(payload) != 4 * numel:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * numel} for {numel} elements")
        if numel == 0:  # torch.frombuffer refuses an empty buffer
            return torch.zeros(0)
        # bytearray: torch.frombuffer needs a writable buffer to avoid a warning, and the
        # decoded tensor must own its memory once the message is gone.
        return torch.frombuffer(bytearray(payload), dtype=torch.float32)

    def decode_into(self, payload: bytes, numel: int, out: torch.Tensor) -> None:
        """``decode`` written into ``out`` (a contiguous float32 CPU tensor of ``numel``
        elements): one copy from the payload, no temporary tensor."""
        if len(payload) != 4 * numel:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * numel} for {numel} elements")
        check_out(out, numel)
        if numel:
            out.numpy()[:] = np.frombuffer(payload, dtype="<f4", count=numel)

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return max(1, chunk_bytes // 4)

    def check_payload(self, payload: bytes, numel: int) -> None:
        """The fused intake's check (the Codec docstring): the length, and every value finite."""
        if len(payload) != 4 * numel:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * numel} for {numel} elements")
        finite = _native.finite_f32(payload) if _native is not None else bool(np.isfinite(np.frombuffer(payload, dtype="<f4")).all())
        if not finite:
            bad = int((~np.isfinite(np.frombuffer(payload, dtype="<f4"))).sum())
            raise CodecError(f"non-finite values: {bad} of {numel}")

    def accumulate(self, payload: bytes, numel: int, out: torch.Tensor, alpha: float) -> None:
        """``out += alpha * values`` in float64, straight from the payload (checked already)."""
        if _native is not None:
            _native.accumulate_f32(payload, out.numpy(), float(alpha))
        elif numel:
            out.add_(torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy()), alpha=alpha)

    def slice_payload(self, payload: bytes, numel: int, start: int, stop: int) -> bytes:
        """The payload of elements [start, stop) of this one: the same values, not re-encoded."""
        return payload[4 * start : 4 * stop]


# Filled by diloco.codec.registry when the package is imported: every codec NAME and
# NAME+zstd with default parameters. Payloads carry their own parameters, so a receiver
# decodes with the default instance whatever block size or density the sender chose.
_CODECS: dict[str, Codec] = {"fp32": Fp32Codec()}


def register_codec(codec: Codec) -> None:
    """Makes ``codec`` the one ``get_codec(codec.name)`` returns."""
    _CODECS[codec.name] = codec


def known_codecs() -> list[str]:
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``; CodecError listing the known names otherwise."""
    try:
        return _CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {quote(name)}; known codecs: {', '.join(known_codecs())}") from None
