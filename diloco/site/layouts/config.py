"""Which layout a site runs (config group ``layout=NAME``; ``site_layouts`` per site).
Plain data: importing this does not import torch.distributed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from diloco.fields import setting

# name -> ranks (torchrun --nproc-per-node) the layout needs
LAYOUT_RANKS = {"single": 1, "ddp2": 2, "fsdp2": 2, "tp2": 2, "pp2": 2, "tp2_fsdp2": 4}


@dataclass(frozen=True)
class LayoutConfig:
    """How a site spreads its model over its ranks (the config group ``layout``, conf/layout)."""

    name: str = setting(
        "single", doc="single (one rank) | ddp2 | fsdp2 | tp2 | pp2 (2 ranks each) | tp2_fsdp2 (4 ranks: tp2 in each pair, FSDP2 across the pairs)"
    )
    activation_checkpointing: bool = setting(False, doc="recompute each block's activations in backward (the built-in transformer only)")
    microbatches: int = setting(2, doc="pipeline layouts (pp2): microbatches per step (data.batch_size must be a multiple); the others ignore it")

    def __post_init__(self) -> None:
        if self.name not in LAYOUT_RANKS:
            raise ValueError(f"layout={self.name!r}: unknown; known layouts: {', '.join(LAYOUT_RANKS)}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"layout.microbatches={self.microbatches!r}: must be an integer >= 1")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"layout.activation_checkpointing={self.activation_checkpointing!r}: must be true or false")

    @property
    def ranks(self) -> int:
        return LAYOUT_RANKS[self.name]

    def named(self, name: str) -> LayoutConfig:
        return replace(self, name=name)


def layout_config(value: LayoutConfig | str | Mapping[str, Any] | None) -> LayoutConfig:
    if value is None:
        return LayoutConfig()
    if isinstance(value, LayoutConfig):
        return value
    if isinstance(value, str):
        return LayoutConfig(name=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"name", "activation_checkpointing", "microbatches"})
        if unknown:
            raise ValueError(f"unknown layout key(s) {', '.join(unknown)}; known: activation_checkpointing, microbatches, name")
        return LayoutConfig(**dict(value))
    raise ValueError(f"layout={value!r}: must be a layout name or a mapping")
