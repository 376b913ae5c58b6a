"""Codecs turn a flat tensor slice into bytes and back. Imports only torch."""

from diloco.codec.base import Codec, CodecError, get_codec, known_codecs
from diloco.codec.chunks import ChunkAssembler, encode_chunks

__all__ = ["Codec", "CodecError", "ChunkAssembler", "encode_chunks", "get_codec", "known_codecs"]
