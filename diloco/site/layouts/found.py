"""A user's model, parallelised by the user's own trainer, as a site's layout: what each rank
syncs is found from the parameters it holds, not from a layout name.

- A DTensor parameter (FSDP2 ``fully_shard``, ``parallelize_module``, any mesh) is the box its
  placements give this rank; a plain parameter is whole. Wrappers that only rename
  (``DistributedDataParallel``, ``DataParallel``, ``torch.compile``) are seen through.
- The ranks exchange what they hold (names, shapes, dtypes, boxes) once, when the layout is
  made, and check that the distinct boxes of every tensor tile it exactly: a gap, an overlap,
  or two ranks that disagree on a tensor's shape is refused naming the tensor and the ranks.
- Every distinct box is pushed and pulled by one of the ranks that hold it: the largest first,
  each to the least loaded of its holders, so replicas (DDP, the norms of tensor parallelism,
  HSDP) share the work and a site sends one model's worth in all. After a pull, the rank that
  pulled a box broadcasts it to the other ranks holding it, inside the site.
- Pipeline stages hold disjoint sets of names: the site's model is their union.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from diloco.boxes import Box, tiling_problem
from diloco.outer import params_sha256
from diloco.site.layouts.base import DistributedModel, Held, LayoutError, unwrap
from diloco.site.layouts.fsdp import dtensor_box
from diloco.types import TensorSpec
from diloco.wire.chunks import dtype_name


@dataclass(frozen=True)
class _Piece:
    """What one rank holds of one tensor, as exchanged between the ranks (picklable)."""

    shape: tuple[int, ...]  # the whole tensor's
    dtype: str
    box: Box


def _pieces(module: nn.Module) -> dict[str, _Piece]:
    out = {}
    for n, p in module.named_parameters():
        if isinstance(p, DTensor):
            if any(isinstance(pl, Partial) for pl in p.placements):
                raise LayoutError(f"parameter {n!r} has a Partial placement ({p.placements}): a parameter must be sharded or replicated")
            box = dtensor_box(p)
        else:
            box = Box.whole(p.shape)
        out[n] = _Piece(tuple(int(s) for s in p.shape), dtype_name(p.dtype), box)
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check_agreement(given: Sequence[Mapping[str, Any]]) -> None:
    """LayoutError naming the ranks when the ranks of a site were not all given the same
    ``DiLoCo(...)`` arguments (site id, coordinator, settings): a group spanning two sites."""
    for key in given[0]:
        values = [g.get(key) for g in given]
        if any(v != values[0] for v in values):
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            what = "; ".join(f"{_ranks(rs)}: {v}" for v, rs in by_value.items())
            raise LayoutError(f"the ranks of one site were given different {key} ({what}): every rank of a site makes the same DiLoCo(...) call")


@dataclass(frozen=True)
class Plan:
    """Who syncs what, the same on every rank: the site's fingerprint, each distinct box's
    holders and the rank that pushes and pulls it."""

    specs: dict[str, TensorSpec]
    holders: dict[tuple[str, Box], tuple[int, ...]]
    owner: dict[tuple[str, Box], int]


def plan(pieces: Sequence[Mapping[str, _Piece]]) -> Plan:
    """The plan from what every rank holds (``pieces[r]``: rank r's); LayoutError for a tensor
    the ranks disagree on, or whose boxes overlap or leave a gap."""
    by_name: dict[str, dict[int, _Piece]] = {}
    for r, mine in enumerate(pieces):
        for n, piece in mine.items():
            by_name.setdefault(n, {})[r] = piece
    specs, holders = {}, {}
    for n in sorted(by_name):
        held = by_name[n]
        kinds: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for r, piece in held.items():
            kinds.setdefault((piece.shape, piece.dtype), []).append(r)
        if len(kinds) > 1:
            what = "; ".join(f"{_ranks(rs)}: {list(s)} {d}" for (s, d), rs in kinds.items())
            raise LayoutError(
                f"the ranks disagree on parameter {n!r} ({what}): a tensor must have one shape and dtype on every rank "
                "(a slice of it is a DTensor, whose shape is the whole tensor's)"
            )
        (shape, dtype), _ = next(iter(kinds.items()))
        specs[n] = TensorSpec(n, shape, dtype)
        boxes: dict[Box, list[int]] = {}
        for r, piece in held.items():
            boxes.setdefault(piece.box, []).append(r)
        distinct = [b for b in boxes if b.numel > 0] or list(boxes)[:1]
        why = tiling_problem(distinct, shape)
        if why is not None:
            who = "; ".join(f"{b} on {_ranks(boxes[b])}" for b in distinct)
            raise LayoutError(f"parameter {n!r} of shape {list(shape)} is not held exactly once by the site's ranks: {why} ({who})")
        for b in distinct:
            holders[(n, b)] = tuple(sorted(boxes[b]))
    sizes = {key: key[1].numel for key in holders}
    load = [0] * len(pieces)
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k[0], k[1].start)):
        r = min(holders[key], key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    _give_every_rank_a_box(owner, holders, len(pieces))
    return Plan(specs, holders, owner)


def _give_every_rank_a_box(owner: dict[tuple[str, Box], int], holders: Mapping[tuple[str, Box], tuple[int, ...]], ranks: int) -> None:
    """Every rank pushes something (a rank's push with no slice would pull the whole model):
    a rank left with nothing takes the smallest box it holds from an owner that has others;
    LayoutError naming the rank where none can be given (more replicas than tensors)."""
    for r in range(ranks):
        if r in owner.values():
            continue
        count = {o: list(owner.values()).count(o) for o in set(owner.values())}
        movable = sorted((key for key, h in holders.items() if r in h and count[owner[key]] > 1), key=lambda k: (k[1].numel, k[0]))
        if not movable:
            raise LayoutError(
                f"rank {r} of the site would push nothing: the site's {ranks} ranks hold {len(holders)} distinct slices in all "
                "(more replicas than tensors); give DiLoCo a process group of fewer ranks"
            )
        owner[movable[0]] = r


class FoundModel(DistributedModel):
    """A model laid out by the user's trainer over ``group`` (default: the whole world)."""

    name = "found"

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, given: Mapping[str, Any] | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # The arguments first: a rank given other ones must not hang the others in a collective.
        if given is not None:
            check_agreement(self.gather_objects(dict(given)))
        # What each rank holds, or why it cannot say, exchanged before anyone raises (a rank that
        # raised alone would leave the others waiting in the gather).
        try:
            module = unwrap(model)
            mine: tuple[dict[str, _Piece] | None, str | None] = (_pieces(module), None)
        except LayoutError as e:
            mine = (None, f"rank {self.rank}: {e}")
        every = self.gather_objects(mine)
        errors = list(dict.fromkeys(e.split(": ", 1)[1] for _, e in every if e))
        if errors:
            ranks = [r for r, (_, e) in enumerate(every) if e]
            raise LayoutError(f"{_ranks(ranks)} of the site: " + "; ".join(errors))
        self.plan = plan([p for p, _ in every if p is not None])
        self.module = module
        self.model = model
        self.specs = self.plan.specs
        from diloco.site.inner import model_device

        self.device = model_device(module)
        self._params = dict(module.named_parameters())
        # Broadcast groups: one per set of ranks holding one box alike (every rank makes them, in one order).
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for ranks in sorted({h for h in self.plan.holders.values() if len(h) > 1}):
            members = [dist.get_global_rank(self.group, r) for r in ranks]
            self._groups[ranks] = self.group if len(ranks) == self.world else dist.new_group(members)
        self._replicated = sorted((key for key, h in self.plan.holders.items() if len(h) > 1 and self.rank in h), key=lambda k: (k[0], k[1].start))

    def _box(self, name: str) -> Box:
        p = self._params[name]
        return dtensor_box(p) if isinstance(p, DTensor) else Box.whole(p.shape)

    def param(self, name: str) -> torch.Tensor:
        """The parameter ``name`` as this rank holds it (a DTensor, or a plain tensor)."""
        return self._params[name]

    def held(self) -> dict[str, Held]:
        out = {}
        for n, p in self._params.items():
            box = self._box(n)
            if self.plan.owner.get((n, box)) == self.rank:
                out[n] = Held(_local(p), box, True)
        return out

    def after_pull(self) -> None:
        """Each box pulled by one rank is broadcast to the other ranks holding it."""
        with torch.no_grad():
            for key in self._replicated:
                holders = self.plan.holders[key]
                src = dist.get_global_rank(self.group, self.plan.owner[key])
                dist.broadcast(_local(self._params[key[0]]), src=src, group=self._groups[holders])

    def full_state(self) -> dict[str, torch.Tensor]:
        """Whole parameters on every rank (gathered: for checking hashes, never on the sync path)."""
        return self.whole(self.held_values())

    def held_values(self) -> dict[str, torch.Tensor]:
        return {n: h.tensor for n, h in self.held().items()}

    def whole_sha256(self, mine: Mapping[str, torch.Tensor]) -> str:
        """params_sha256 of the whole tensors that every rank's ``mine`` (its own boxes' values,
        as ``held`` names them) make up, on every rank. The tensors are gathered to rank 0 one
        at a time, so no rank holds more than one whole tensor beyond its own: for checking
        hashes at the end of a run, never on the sync path (every rank must call it)."""
        leader = dist.get_global_rank(self.group, 0)
        site = self

        class _OneAtATime(Mapping[str, torch.Tensor]):
            def __iter__(self):  # type: ignore[no-untyped-def]
                return iter(site.specs)

            def __len__(self) -> int:
                return len(site.specs)

            def __getitem__(self, name: str) -> torch.Tensor:
                part = (site._box(name), mine[name].detach().cpu()) if name in mine else None
                parts: list[Any] = [None] * site.world if site.leader else []
                dist.gather_object(part, parts if site.leader else None, dst=leader, group=site.group)
                spec = site.specs[name]
                out = torch.empty(spec.shape if site.leader else (0,), dtype=getattr(torch, spec.dtype))
                for got in parts:
                    if got is not None:
                        out[got[0].slices()] = got[1]
                return out

        digest = [params_sha256(_OneAtATime()) if self.leader else ""]
        if not self.leader:
            params_sha256(_OneAtATime())  # the same gathers, in the same order
        dist.broadcast_object_list(digest, src=leader, group=self.group)
        return digest[0]

    def whole(self, mine: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from every rank's ``mine`` (its own boxes' values, as ``held`` names
        them), on every rank: a gather of the whole model, for hashes at the end of a run."""
        boxes = {n: self._box(n) for n in mine}
        every = self.gather_objects({n: (boxes[n], t.detach().cpu()) for n, t in mine.items()})
        out = {n: torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for n, s in self.specs.items()}
        for part in every:
            for n, (box, t) in part.items():
                out[n][box.slices()] = t
        return out
