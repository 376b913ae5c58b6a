"""Tensor parallelism (DTensor, Megatron style) over the ranks of a site: in every block,
q, k, v, gate and up are split by rows (column-wise parallel: each rank computes some of the
heads and some of the MLP's hidden units) and proj and down by columns (row-wise parallel:
their partial outputs are summed). Embeddings and norms stay whole on every rank.

Each rank syncs the rows or columns it holds; a tensor every rank holds whole (an embedding,
a norm) is pushed by the first rank holding it and pulled by each."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from diloco.site.layouts.base import DistributedModel, Held
from diloco.site.layouts.fsdp import dtensor_held

BLOCK_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Applies BLOCK_PLAN to every block of ``model`` over the 1-D ``mesh``."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and (cfg.n_heads % mesh.size() or cfg.mlp_hidden % mesh.size()):
        raise ValueError(f"tensor parallelism over {mesh.size()} ranks needs model.n_heads and model.mlp_hidden divisible by {mesh.size()}")
    for block in model.blocks:
        parallelize_module(block, mesh, BLOCK_PLAN)


def first_holder(p: torch.Tensor, rank: int) -> bool:
    """Whether this rank pushes ``p``'s local part: a plain tensor (whole on every rank) from
    rank 0; a DTensor from the ranks at coordinate 0 of each mesh dimension it is replicated on."""
    if not isinstance(p, DTensor):
        return rank == 0
    return all(p.device_mesh.get_local_rank(i) == 0 for i, pl in enumerate(p.placements) if isinstance(pl, Replicate))


class TensorParallelModel(DistributedModel):
    name = "tp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (self.world,))
        tensor_parallel(model, mesh)

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y  # every rank computes on the whole batch (its part of each layer)

    def held(self) -> dict[str, Held]:
        return dtensor_held(self.module, lambda _name, p: first_holder(p, self.rank))

    def full_state(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in self.module.named_parameters()}
