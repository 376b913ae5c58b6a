"""Tensor parallelism (DTensor, Megatron style) of the built-in transformer on the ``tp``
dimension of a site's mesh: in every block, q, k, v, gate and up are split by rows (column-wise
parallel: each rank computes some of the heads and some of the MLP's hidden units) and proj and
down by columns (row-wise parallel: their partial outputs are summed). Embeddings and norms
stay whole on every tp rank; which rank pushes them is FoundModel's choice (layouts/found.py)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    """Applies BLOCK_PLAN to every block of the built-in transformer over ``mesh["tp"]``."""
    tp = mesh["tp"] if mesh.ndim > 1 else mesh
    cfg = getattr(model, "cfg", None)
    if cfg is not None and (cfg.n_heads % tp.size() or cfg.mlp_hidden % tp.size()):
        raise ValueError(f"tensor parallelism over {tp.size()} ranks needs model.n_heads and model.mlp_hidden divisible by {tp.size()}")
    for block in model.blocks:
        if isinstance(block, nn.Identity):
            continue  # another pipeline stage's
        parallelize_module(block, tp, BLOCK_PLAN)
