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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from diloco.site.layouts.base import DistributedModel, Held
from diloco.site.layouts.fsdp import dtensor_held, full_dtensor_state

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


def first_holder(p: torch.Tensor, site_mesh: DeviceMesh) -> bool:
    """Whether this rank pushes ``p``'s local part, so that each is pushed once: this rank
    must be at coordinate 0 of every dimension of the site's mesh along which ``p`` is not
    split (a plain tensor: every dimension; a DTensor: those it is replicated on, and those
    its own mesh does not have)."""
    split: set[str] = set()
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ()
        split = {names[i] for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate) and i < len(names)}
    names = site_mesh.mesh_dim_names or tuple(str(i) for i in range(site_mesh.ndim))
    return all(site_mesh.get_local_rank(i) == 0 for i, name in enumerate(names) if name not in split)


class TensorParallelModel(DistributedModel):
    name = "tp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("tp",))
        tensor_parallel(model, self.mesh)

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y  # every rank computes on the whole batch (its part of each layer)

    def held(self) -> dict[str, Held]:
        return dtensor_held(self.module, lambda _name, p: first_holder(p, self.mesh))

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_dtensor_state(self.module)


class TensorFSDPModel(DistributedModel):
    """A 2-D mesh (dp × tp) over 4 ranks: tensor parallel inside each pair of ranks, FSDP2
    across the pairs (each tp rank's part is sharded once more, by rows). Each rank syncs the
    box it holds; what both tp ranks of a dp row hold alike (norms, embedding) tp rank 0 pushes."""

    name = "tp_fsdp"

    def __init__(self, model: nn.Module, tp: int = 2) -> None:
        super().__init__(model)
        if self.world % tp:
            raise ValueError(f"layout tp2_fsdp2: {self.world} ranks do not split into tensor-parallel groups of {tp}")
        self.mesh = init_device_mesh(self.device.type, (self.world // tp, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, self.mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dp, n = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        if x.shape[0] % n:
            raise ValueError(f"layout tp2_fsdp2: data.batch_size={x.shape[0]} must be a multiple of its {n} data-parallel groups")
        return x.chunk(n)[dp], y.chunk(n)[dp]  # the tp ranks of a dp group share its part

    def held(self) -> dict[str, Held]:
        return dtensor_held(self.module, lambda _name, p: first_holder(p, self.mesh))

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_dtensor_state(self.module)
