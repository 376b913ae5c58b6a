"""Sharded data parallel (FSDP2 ``fully_shard``): every parameter is a DTensor sharded on
dimension 0; each rank pushes and pulls the rows it holds."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from diloco.boxes import Box
from diloco.site.layouts.base import DistributedModel, Held


def dtensor_box(p: DTensor) -> Box:
    """The slice of the whole tensor that this rank's local part of ``p`` is."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def dtensor_held(module: nn.Module, pusher: Callable[[str, torch.Tensor], bool] | None = None) -> dict[str, Held]:
    """Every non-empty local part of the module's DTensor parameters (plain tensors: whole);
    ``pusher(name, param)`` says whether this rank pushes it (default: every rank)."""
    out = {}
    for n, p in module.named_parameters():
        if isinstance(p, DTensor):
            box, local = dtensor_box(p), p.to_local()
        else:
            box, local = Box.whole(p.shape), p.data
        if box.numel == 0:
            continue
        out[n] = Held(local.detach(), box, True if pusher is None else pusher(n, p))
    return out


class FSDPModel(DistributedModel):
    name = "fsdp"

    def __init__(self, model: nn.Module, activation_checkpointing: bool = False) -> None:
        super().__init__(model)
        mesh = init_device_mesh(self.device.type, (self.world,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def held(self) -> dict[str, Held]:
        return dtensor_held(self.module)

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_dtensor_state(self.module)


def full_dtensor_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters, DTensors gathered (every rank must call it)."""
    return {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in module.named_parameters()}
