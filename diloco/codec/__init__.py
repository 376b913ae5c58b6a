"""Value codecs: a flat float32 tensor to bytes and back. Imports torch, numpy, zstandard.

Importing this package registers every codec (see registry.py): fp32, fp16, bf16, int8,
int4, e3m0, topk2bit, and each of them followed by zstd (NAME+zstd). Cutting tensors into
chunks (the framing on the wire) is diloco.wire's.
"""

from diloco.codec.base import Codec, CodecError, get_codec, known_codecs
from diloco.codec.config import CodecConfig, codec_config
from diloco.codec.registry import best_settings, is_lossless, make_codec

__all__ = ["Codec", "CodecConfig", "CodecError", "best_settings", "codec_config", "get_codec", "is_lossless", "known_codecs", "make_codec"]
