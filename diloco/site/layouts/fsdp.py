"""Sharded data parallel (FSDP2 ``fully_shard``) on the ``dp_shard`` dimension of a site's
mesh, HSDP (replicas of shards) with ``dp_replicate`` too: every block is its own FSDP unit,
the root holds the rest. And the box of a DTensor's local part, which is what a rank syncs."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from diloco.boxes import Box


def dtensor_box(p: DTensor) -> Box:
    """The slice of the whole tensor that this rank's local part of ``p`` is."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def shard(root: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """fully_shard each of ``blocks`` (those with parameters), then ``root`` over ``mesh``
    (1-D: FSDP; 2-D (replicate, shard): HSDP)."""
    for block in blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)


def full_dtensor_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters, DTensors gathered (every rank must call it)."""
    return {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in module.named_parameters()}
