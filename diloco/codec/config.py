"""A codec chosen by configuration: its name, its parameters and whether zstd follows it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from diloco.codec.base import Codec
from diloco.codec.registry import ZSTD_SUFFIX, make_codec
from diloco.fields import setting


@dataclass(frozen=True)
class CodecConfig:
    """A codec section (``codec``, ``codec_down``; conf/codec). A parameter the codec does not
    take is an error, never silently ignored; the shipped configs carry zstd_level for every codec."""

    name: str = setting("fp32", doc="the encoding: fp32 | fp16 | bf16 | int8 | int4 | e3m0 | topk2bit (conf/codec)")
    zstd: bool = setting(False, doc="follow the codec with zstd, after a byte-plane shuffle")
    zstd_level: int = setting(3, doc="zstd's compression level; read only with zstd=true")
    block: int | None = setting(
        None,
        doc="int8, int4, e3m0: values per float32 scale; topk2bit: values per top-k selection; null: the codec's default (int8, e3m0 1024; int4 128; topk2bit 4096)",
    )
    density: float | None = setting(None, doc="topk2bit: the share of each block's values kept (the largest magnitudes); null: 0.02")

    def __post_init__(self) -> None:
        if not isinstance(self.zstd, bool):
            raise ValueError(f"zstd={self.zstd!r}: must be true or false")
        self.build()  # unknown names and bad parameters fail here, naming what was wrong

    @property
    def wire_name(self) -> str:
        """The name chunks carry (NAME or NAME+zstd); a receiver needs nothing else to decode."""
        return self.name + (ZSTD_SUFFIX if self.zstd else "")

    def build(self) -> Codec:
        return make_codec(self.wire_name, block=self.block, density=self.density, zstd_level=self.zstd_level if self.zstd else None)

    def describe(self) -> str:
        """e.g. ``int8(block=1024)+zstd(level=3)``: the name with every parameter in effect."""
        codec = self.build()
        inner = getattr(codec, "inner", codec)
        params = [f"{k}={getattr(inner, k)}" for k in ("block", "density") if hasattr(inner, k)]
        text = self.name + (f"({', '.join(params)})" if params else "")
        return text + (f"+zstd(level={self.zstd_level})" if self.zstd else "")


def codec_config(value: CodecConfig | str | Mapping[str, Any]) -> CodecConfig:
    """A CodecConfig from itself, a wire name (``"int8"``, ``"int8+zstd"``) or a mapping of its fields."""
    if isinstance(value, CodecConfig):
        return value
    if isinstance(value, str):
        return CodecConfig(name=value.removesuffix(ZSTD_SUFFIX), zstd=value.endswith(ZSTD_SUFFIX))
    if isinstance(value, Mapping):
        known = {f.name for f in fields(CodecConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown codec key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return CodecConfig(**dict(value))
    raise ValueError(f"a codec is a name such as 'int8' or a mapping with a name, not {type(value).__name__}")
