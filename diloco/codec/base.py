"""The codec interface and the registry of codecs by name."""

from __future__ import annotations

from typing import Protocol

import torch


class CodecError(ValueError):
    """A payload that cannot be decoded as declared; the message says what disagrees."""


class Codec(Protocol):
    """Encodes a 1-D float32 tensor slice to bytes and decodes it back.

    ``decode(encode(x), x.numel())`` returns a new float32 tensor of the same numel; lossy
    codecs return an approximation. ``max_chunk_numel(n_bytes)`` is the most elements whose
    encoding is guaranteed to fit in n_bytes, so chunks stay under the transport's limit.
    """

    name: str

    def encode(self, flat: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes, numel: int) -> torch.Tensor: ...

    def max_chunk_numel(self, chunk_bytes: int) -> int: ...


class Fp32Codec:
    """Raw little-endian float32: the lossless reference."""

    name = "fp32"

    def encode(self, flat: torch.Tensor) -> bytes:
        return flat.detach().to(torch.float32).contiguous().numpy().tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        if len(payload) != 4 * numel:
            raise CodecError(f"fp32 payload has {len(payload)} bytes, expected {4 * numel} for {numel} elements")
        # bytearray: torch.frombuffer needs a writable buffer to avoid a warning, and the
        # decoded tensor must own its memory once the message is gone.
        return torch.frombuffer(bytearray(payload), dtype=torch.float32)

    def max_chunk_numel(self, chunk_bytes: int) -> int:
        return max(1, chunk_bytes // 4)


_CODECS: dict[str, Codec] = {"fp32": Fp32Codec()}


def known_codecs() -> list[str]:
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``; CodecError listing the known names otherwise."""
    try:
        return _CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(known_codecs())}") from None
