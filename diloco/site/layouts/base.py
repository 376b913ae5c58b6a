"""What a layout gives the rest of a site: the model to train, this rank's share of each
batch, and the parameter slices this rank keeps in sync with the coordinator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from diloco.boxes import Box
from diloco.site.inner import clip_grad_norm, model_device
from diloco.types import TensorSpec
from diloco.wire.fingerprint import fingerprint

T = TypeVar("T")


class LayoutError(ValueError):
    """The ranks of a site hold parameters that do not make one model (a gap, an overlap, ranks
    that disagree) or that the site cannot see into; the message names the tensor and ranks."""


# Wrappers whose only effect on the parameters is a prefix: the site reads the module inside.
_SEE_THROUGH = (("DistributedDataParallel", "module"), ("DataParallel", "module"), ("OptimizedModule", "_orig_mod"))


def see_through(model: nn.Module) -> nn.Module:
    """``model`` without the wrappers that only rename its parameters (DDP, DataParallel,
    ``torch.compile``): the user's module."""
    seen = True
    while seen:
        seen = False
        for cls, attr in _SEE_THROUGH:
            if type(model).__name__ == cls and isinstance(getattr(model, attr, None), nn.Module):
                model, seen = getattr(model, attr), True
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """``see_through(model)``; LayoutError for FSDP1, whose flat parameters hide which slices
    of which tensors a rank holds."""
    model = see_through(model)
    for name, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter" or "_fsdp_wrapped_module" in name or name.endswith("_flat_param"):
            raise LayoutError(
                f"parameter {name!r} is a flat parameter of FullyShardedDataParallel (FSDP1): a site cannot see which slices "
                "of which tensors it holds; shard the model with torch.distributed.fsdp.fully_shard (FSDP2) instead"
            )
    return model


@dataclass(frozen=True)
class Held:
    """One slice of one parameter that this rank keeps in sync."""

    tensor: torch.Tensor  # the live local values (a view of the parameter's storage)
    box: Box  # where they lie in the whole tensor
    push: bool  # this rank sends their Δ (False: another rank holding the same slice sends it)


class ParallelModel:
    """A model laid out over the ranks of one site. This base class is the one-rank case."""

    name = "single"
    # A layout that runs forward and backward its own way (a pipeline schedule) sets this to
    # a function (x, y) -> loss in nats per token; None: the trainer runs the model.
    forward_backward: Callable[[torch.Tensor, torch.Tensor], float] | None = None

    def __init__(self, model: nn.Module) -> None:
        self.module = model  # the model as built (every rank builds the same one)
        self.model: nn.Module = model  # what the inner trainer runs (maybe a wrapper)
        self.specs: dict[str, TensorSpec] = fingerprint(dict(model.named_parameters()))
        self.rank = 0
        self.world = 1

    @property
    def leader(self) -> bool:
        """The rank that joins, heartbeats and leaves for the site."""
        return self.rank == 0

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the site's batch."""
        return x, y

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        """Scales the gradients so that the norm of the whole model's gradient is at most max_norm."""
        clip_grad_norm(params, max_norm)

    def held(self) -> dict[str, Held]:
        """The slices this rank syncs (every one of them it pulls; those with ``push`` it pushes)."""
        return {n: Held(p.data, Box.whole(p.shape), True) for n, p in self.module.named_parameters()}

    def after_pull(self) -> None:
        """Called by every rank once the pulled slices are in place (DDP: owners broadcast)."""

    def agree(self, flags: int) -> int:
        """The union (bitwise or) of ``flags`` over the site's ranks (every rank must call it)."""
        return flags

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the site's ranks (every rank must call it)."""
        return value

    def sum(self, values: Sequence[float]) -> list[float]:
        """The sums of ``values`` over the site's ranks (every rank must call it)."""
        return [float(v) for v in values]

    def from_leader(self, fn: Callable[[], T]) -> T:
        """``fn()`` called on the leader rank only; every rank returns its result (every rank
        must call it). When it raises, the leader raises that, the other ranks a RuntimeError
        with its message."""
        return fn()

    def barrier(self) -> None:
        pass

    def on_every_rank(self, fn: Callable[[], None], what: str) -> None:
        """``fn()`` on every rank, then a barrier that also carries failures: a rank whose
        ``fn`` raised raises that, the others a RuntimeError ``what: rank R: ...`` (every rank
        must call it), so no rank goes on, or waits, without the others."""
        fn()

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (every rank must call it)."""
        return [obj]

    def full_state(self) -> dict[str, torch.Tensor]:
        """Whole parameters, gathered if need be: for verifying hashes at the end of a run,
        never on the sync path (every rank must call it)."""
        return {n: p.detach() for n, p in self.module.named_parameters()}


_FLAG_BITS = 16


class DistributedModel(ParallelModel):
    """A layout over the ranks of a torch.distributed process group (the site's torchrun)."""

    group: Any = None  # the site's process group (None: the whole world)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # Where the model's parameters live (the CPU, or this rank's GPU): device meshes and
        # pipeline stages are of that device; nccl carries their collectives on a GPU.
        self.device = model_device(model)

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] % self.world:
            raise ValueError(f"layout {self.name}: data.batch_size={x.shape[0]} must be a multiple of its {self.world} ranks")
        return x.chunk(self.world)[self.rank], y.chunk(self.world)[self.rank]

    def agree(self, flags: int) -> int:
        bits = torch.tensor([(flags >> i) & 1 for i in range(_FLAG_BITS)], dtype=torch.int64)
        dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=self.group)
        return sum(int(b) << i for i, b in enumerate(bits.tolist()))

    def mean(self, value: float) -> float:
        return self.sum([value])[0] / self.world

    def sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return [float(v) for v in t.tolist()]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_every_rank(self, fn: Callable[[], None], what: str) -> None:
        error: Exception | None = None
        try:
            fn()
        except Exception as e:
            error = e
        failed = [f"rank {r}: {why}" for r, why in enumerate(self.gather_objects(None if error is None else str(error))) if why]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{what}: " + "; ".join(failed))

    def from_leader(self, fn: Callable[[], T]) -> T:
        result: list[Any] = [None]
        error: Exception | None = None
        if self.leader:
            try:
                result[0] = ("ok", fn())
            except Exception as e:  # the other ranks raise it too, by its message
                error = e
                result[0] = ("error", f"{type(e).__name__}: {e}")
        leader = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(result, src=leader, group=self.group)
        if error is not None:
            raise error
        kind, value = result[0]
        if kind == "error":
            raise RuntimeError(f"the site's rank 0 failed: {value}")
        return value
