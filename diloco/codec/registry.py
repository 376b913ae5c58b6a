"""Every codec by name, and ``make_codec`` for non-default parameters.

A payload carries its own parameters (block size, k and index format) in its header and
zstd needs none to decode, so the wire name is just NAME or NAME+zstd: a receiver decodes
with the default instance ``get_codec(name)`` whatever parameters the sender chose.
"""

from __future__ import annotations

from diloco.codec.base import Codec, CodecError, Fp32Codec, register_codec
from diloco.codec.blockwise import E3M0Codec, Int4Codec, Int8Codec
from diloco.codec.floats import Bf16Codec, Fp16Codec
from diloco.codec.topk import TopK2BitCodec
from diloco.codec.zstd import ZstdCodec

_BLOCKWISE = {"int8": Int8Codec, "int4": Int4Codec, "e3m0": E3M0Codec}
_PLAIN = {"fp32": Fp32Codec, "fp16": Fp16Codec, "bf16": Bf16Codec}
BASE_NAMES = (*_PLAIN, *_BLOCKWISE, "topk2bit")
ZSTD_SUFFIX = "+zstd"


def make_codec(name: str, *, block: int | None = None, density: float | None = None, zstd_level: int | None = None) -> Codec:
    """A codec named ``name`` (NAME or NAME+zstd) with the given parameters.

    ``block`` applies to int8 / int4 / e3m0 / topk2bit, ``density`` to topk2bit, ``zstd_level`` to
    +zstd names; a parameter the codec does not take is a ValueError, not ignored.
    Unknown names raise CodecError listing the known ones.
    """
    base = name.removesuffix(ZSTD_SUFFIX)
    zstd = base != name
    if base not in BASE_NAMES:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(BASE_NAMES)} (each also as NAME{ZSTD_SUFFIX})")
    if block is not None and base not in (*_BLOCKWISE, "topk2bit"):
        raise ValueError(f"codec {name!r} takes no block size (only {', '.join(_BLOCKWISE)} and topk2bit do)")
    if density is not None and base != "topk2bit":
        raise ValueError(f"codec {name!r} takes no density (only topk2bit does)")
    if zstd_level is not None and not zstd:
        raise ValueError(f"codec {name!r} takes no zstd level (only NAME{ZSTD_SUFFIX} codecs do)")
    if base in _BLOCKWISE:
        inner: Codec = _BLOCKWISE[base](block)
    elif base == "topk2bit":
        inner = TopK2BitCodec(**{k: v for k, v in (("density", density), ("block", block)) if v is not None})
    else:
        inner = _PLAIN[base]()
    if not zstd:
        return inner
    return ZstdCodec(inner) if zstd_level is None else ZstdCodec(inner, zstd_level)


# The run settings each codec trains best with (measured: docs/results.md, "Codecs"), used
# wherever a run leaves them unset: ``aggregate`` (the coordinator's mean of Δ),
# ``error_feedback_decay`` (β of the sites' error feedback) and ``outer`` (fields of the outer
# optimizer; {}: OuterConfig's own defaults, DiLoCo's Nesterov SGD). A sparse codec's Δ is
# "not yet" where a site did not send a coordinate, not zero (so nonzero-aware averaging), its
# residual arrives stale (so a shorter memory), and the residual already carries momentum-like
# memory (so a plain SGD outer step, as SparseLoCo). Dense codecs: the plain mean, β = 1.
_BEST_SETTINGS: dict[str, dict[str, object]] = {
    "topk2bit": {"aggregate": "nonzero", "error_feedback_decay": 0.8, "outer": {"name": "SGD", "lr": 1.25, "momentum": 0.0, "nesterov": False}},
}
_DENSE_SETTINGS: dict[str, object] = {"aggregate": "mean", "error_feedback_decay": 1.0, "outer": {}}


def best_settings(name: str) -> dict[str, object]:
    """{"aggregate", "error_feedback_decay", "outer"} a run with codec ``name`` (NAME or
    NAME+zstd) uses where it does not set them."""
    best = _BEST_SETTINGS.get(name.removesuffix(ZSTD_SUFFIX), _DENSE_SETTINGS)
    return {k: dict(v) if isinstance(v, dict) else v for k, v in best.items()}


def is_lossless(name: str) -> bool:
    """True for codecs whose decode(encode(x)) is exactly x (no error feedback needed)."""
    return name.removesuffix(ZSTD_SUFFIX) == "fp32"


for _name in BASE_NAMES:
    register_codec(make_codec(_name))
    register_codec(make_codec(_name + ZSTD_SUFFIX))
