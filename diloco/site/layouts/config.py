"""How a site spreads its model over its ranks, as config. Plain data: importing this does not
import torch.distributed.

The degrees of parallelism (the ``parallel`` section) multiply to the site's ranks (torchrun
--nproc-per-node), as in torchtitan's ParallelDims: ``dp_replicate`` × ``dp_shard`` × ``tp`` ×
``pp``. The layout names (the config group ``layout``, ``site_layouts``) are shorthands for
some of them; a degree set in ``parallel`` replaces the name's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from diloco.fields import setting

# The dimensions of a site's device mesh, outermost first (tensor parallelism innermost: its
# collectives run every layer, so its ranks should be the closest).
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# What each layout name stands for (a degree left out is 1).
SHORTHANDS: dict[str, dict[str, int]] = {
    "single": {},
    "ddp2": {"dp_replicate": 2},
    "fsdp2": {"dp_shard": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "tp2_fsdp2": {"dp_shard": 2, "tp": 2},
}
# name -> ranks (torchrun --nproc-per-node) the layout needs
LAYOUT_RANKS = {name: math.prod(d.values()) for name, d in SHORTHANDS.items()}
REST = -1  # parallel.dp_shard=-1: whatever the other degrees leave of the site's ranks


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LayoutConfig:
    """A layout name and what goes with it (the config group ``layout``, conf/layout)."""

    name: str = setting(
        "single",
        doc="a shorthand for the parallel degrees: single (one rank) | ddp2 (dp_replicate=2) | fsdp2 (dp_shard=2) | tp2 (tp=2) | pp2 (pp=2) | tp2_fsdp2 (dp_shard=2, tp=2)",
    )
    activation_checkpointing: bool = setting(False, doc="recompute each block's activations in backward (the built-in transformer only)")

    def __post_init__(self) -> None:
        if self.name not in SHORTHANDS:
            raise ValueError(f"layout={self.name!r}: unknown; known layouts: {', '.join(SHORTHANDS)}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"layout.activation_checkpointing={self.activation_checkpointing!r}: must be true or false")

    @property
    def ranks(self) -> int:
        return LAYOUT_RANKS[self.name]

    def named(self, name: str) -> LayoutConfig:
        return replace(self, name=name)


@dataclass(frozen=True)
class ParallelConfig:
    """The degrees of parallelism inside a site (the ``parallel`` section); null: the layout
    name's (1 where the name says nothing)."""

    dp_replicate: int | None = setting(None, doc="data-parallel replicas (DDP; with dp_shard > 1, HSDP's replicas); null: the layout's")
    dp_shard: int | None = setting(
        None, doc="data-parallel shards (FSDP2 fully_shard); -1: the site's ranks left by the other degrees (diloco-site only); null: the layout's"
    )
    tp: int | None = setting(
        None, doc="tensor-parallel ranks (Megatron style; model=custom/hf need model.parallelize); it divides the heads and the MLP width; null: the layout's"
    )
    pp: int | None = setting(None, doc="pipeline stages (the built-in transformer; at most its layers); null: the layout's")
    pp_microbatches: int = setting(2, doc="pp > 1: microbatches per step through the 1F1B schedule (each data-parallel share of data.batch_size is a multiple)")

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"parallel.{name}={value!r}: must be an integer >= 1 (or null: the layout's)")
        if self.dp_shard is not None and (not _is_int(self.dp_shard) or (self.dp_shard < 1 and self.dp_shard != REST)):
            raise ValueError(f"parallel.dp_shard={self.dp_shard!r}: must be an integer >= 1, or -1 (the ranks left), or null (the layout's)")
        if not _is_int(self.pp_microbatches) or self.pp_microbatches < 1:
            raise ValueError(f"parallel.pp_microbatches={self.pp_microbatches!r}: must be an integer >= 1")

    @property
    def degrees(self) -> dict[str, int]:
        """The degrees set here (the others come from the layout name)."""
        return {d: getattr(self, d) for d in DIMS if getattr(self, d) is not None}


@dataclass(frozen=True)
class ParallelDims:
    """What one site builds: its degrees (resolved from a layout name and the ``parallel``
    section), the pipeline's microbatches and activation checkpointing."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1  # REST: decided by the ranks the site is launched with
    tp: int = 1
    microbatches: int = 2
    activation_checkpointing: bool = False
    layout: str = "single"  # the layout name the degrees started from
    explicit: tuple[str, ...] = ()  # the degrees the parallel section set

    @classmethod
    def of(cls, layout: LayoutConfig, parallel: ParallelConfig | None = None) -> ParallelDims:
        parallel = parallel or ParallelConfig()
        degrees = {**SHORTHANDS[layout.name], **parallel.degrees}
        return cls(
            **degrees,
            microbatches=parallel.pp_microbatches,
            activation_checkpointing=layout.activation_checkpointing,
            layout=layout.name,
            explicit=tuple(parallel.degrees),
        )

    @classmethod
    def named(cls, name: str) -> ParallelDims:
        return cls.of(LayoutConfig(name=name))

    def key(self, dim: str) -> str:
        """How a degree is named in an error: ``parallel.tp=4``, or ``tp=2 (layout=tp2)``."""
        value = getattr(self, dim)
        return f"parallel.{dim}={value}" if dim in self.explicit else f"{dim}={value} (layout={self.layout})"

    @property
    def degrees(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def ranks(self) -> int | None:
        """The ranks this needs; None when dp_shard is -1 (the ranks it is launched with decide)."""
        return None if self.dp_shard == REST else math.prod(self.degrees.values())

    @property
    def dp(self) -> int:
        """Data-parallel groups: each trains on its own share of the site's batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        """The layout name when the degrees are a shorthand's, else the degrees above 1
        (``dp_shard2_tp4``; ``single`` for one rank)."""
        if self.degrees == {**dict.fromkeys(DIMS, 1), **SHORTHANDS[self.layout]}:
            return self.layout
        for name, short in SHORTHANDS.items():
            if self.degrees == {**dict.fromkeys(DIMS, 1), **short}:
                return name
        return "_".join(f"{d}{v}" for d, v in self.degrees.items() if v != 1) or "single"

    def keys(self, dims: tuple[str, ...] = DIMS) -> str:
        """The keys of those of ``dims`` that are set or above 1: ``parallel.dp_shard=2 × tp=2 (layout=tp2)``."""
        return " × ".join(self.key(d) for d in dims if getattr(self, d) != 1 or d in self.explicit) or "one rank"

    def describe(self) -> str:
        """``layout fsdp2``, or the degrees: ``parallel.dp_shard=2 × parallel.tp=4``."""
        return f"layout {self.layout}" if not self.explicit else self.keys()

    def for_ranks(self, ranks: int) -> ParallelDims:
        """These degrees over ``ranks`` ranks: dp_shard=-1 filled in; ValueError naming the keys
        when they do not multiply to ``ranks``."""
        if self.dp_shard == REST:
            others = self.pp * self.dp_replicate * self.tp
            if ranks % others:
                raise ValueError(
                    f"parallel.dp_shard=-1: the site's {ranks} rank(s) do not divide by the other degrees' product {others} "
                    f"({self.keys(('pp', 'dp_replicate', 'tp'))})"
                )
            return replace(self, dp_shard=ranks // others)
        if self.ranks != ranks:
            raise ValueError(
                f"{self.describe()} needs {self.ranks} rank(s); this site was launched with {ranks} (start it with torchrun --nproc-per-node={self.ranks})"
            )
        return self

    def check_batch(self, batch_size: int) -> None:
        """ValueError naming the keys when ``data.batch_size`` does not split into the
        data-parallel shares (and each share into the pipeline's microbatches)."""
        if self.dp_shard == REST:
            return  # known once the site's ranks are
        if batch_size % self.dp:
            raise ValueError(
                f"data.batch_size={batch_size}: must be a multiple of the site's {self.dp} data-parallel groups ({self.keys(('dp_replicate', 'dp_shard'))})"
            )
        if self.pp > 1 and self.microbatches < self.pp:
            raise ValueError(f"parallel.pp_microbatches={self.microbatches}: the 1F1B schedule needs at least one microbatch per stage ({self.key('pp')})")
        if self.pp > 1 and (batch_size // self.dp) % self.microbatches:
            raise ValueError(
                f"data.batch_size={batch_size}: each of the {self.dp} data-parallel share(s), {batch_size // self.dp} sequences, "
                f"must be a multiple of parallel.pp_microbatches={self.microbatches} ({self.key('pp')})"
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place on each dimension of the mesh (row-major over DIMS)."""
        out, rest = {}, rank
        for d in reversed(DIMS):
            out[d] = rest % getattr(self, d)
            rest //= getattr(self, d)
        return {d: out[d] for d in DIMS}


def layout_config(value: LayoutConfig | str | Mapping[str, Any] | None) -> LayoutConfig:
    if value is None:
        return LayoutConfig()
    if isinstance(value, LayoutConfig):
        return value
    if isinstance(value, str):
        return LayoutConfig(name=value)
    if isinstance(value, Mapping):
        known = sorted(f.name for f in fields(LayoutConfig))
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown layout key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return LayoutConfig(**dict(value))
    raise ValueError(f"layout={value!r}: must be a layout name or a mapping")


def parallel_config(value: ParallelConfig | Mapping[str, Any] | None) -> ParallelConfig:
    if value is None:
        return ParallelConfig()
    if isinstance(value, ParallelConfig):
        return value
    if isinstance(value, Mapping):
        known = sorted(f.name for f in fields(ParallelConfig))
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown config key(s) {', '.join('parallel.' + k for k in unknown)}; known: {', '.join(known)}")
        return ParallelConfig(**dict(value))
    raise ValueError(f"parallel={value!r}: must be a mapping of its degrees")
