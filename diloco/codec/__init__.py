"""Codecs turn a flat tensor slice into bytes and back. Imports torch, numpy, zstandard.

Importing this package registers every codec (see registry.py): fp32, fp16, bf16, int8,
int4, e3m0, topk2bit, and each of them followed by zstd (NAME+zstd).
"""

from diloco.codec.base import Codec, CodecError, get_codec, known_codecs
from diloco.codec.chunks import ChunkAssembler, SliceAssembler, check_part, chunks_overlapping, encode_chunks
from diloco.codec.config import CodecConfig, codec_config
from diloco.codec.registry import is_lossless, make_codec

__all__ = [
    "Codec", "CodecConfig", "CodecError", "ChunkAssembler", "SliceAssembler", "check_part", "chunks_overlapping", "codec_config", "encode_chunks", "get_codec", "is_lossless", "known_codecs", "make_codec",
]  # fmt: skip
