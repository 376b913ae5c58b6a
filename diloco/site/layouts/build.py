"""Starts a site's process group (under torchrun) and builds its layout."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.site.layouts.base import ParallelModel
from diloco.site.layouts.config import LayoutConfig


def launched_ranks() -> int:
    """The number of processes torchrun started for this site (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_site_group(layout: LayoutConfig, device: torch.device | None = None) -> None:
    """Joins the site's process group, after checking that torchrun started as many ranks as
    the layout needs. Collectives on CPU tensors go over gloo, on GPU tensors (where there is
    a GPU) over nccl: torch picks per tensor. ``device``: the rank's GPU, bound to the group
    so nccl needs no guess."""
    launched = launched_ranks()
    if launched != layout.ranks:
        raise ValueError(
            f"layout {layout.name} needs {layout.ranks} rank(s); this site was launched with {launched} "
            f"(start it with torchrun --nproc-per-node={layout.ranks})"
        )
    if layout.ranks > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            on_gpu = device is not None and device.type == "cuda"
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device if on_gpu else None)
        else:
            dist.init_process_group("gloo")


def close_site_group() -> None:
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective
        dist.destroy_process_group()


def build_layout(layout: LayoutConfig, model: nn.Module) -> ParallelModel:
    """``model`` laid out as ``layout`` says; every rank passes the same freshly built model."""
    if layout.activation_checkpointing:
        from diloco.site.layouts.checkpointing import checkpoint_blocks

        checkpoint_blocks(model)
    if layout.name == "single":
        return ParallelModel(model)
    if layout.name == "ddp2":
        from diloco.site.layouts.ddp import DDPModel

        return DDPModel(model)
    if layout.name == "fsdp2":
        from diloco.site.layouts.fsdp import FSDPModel

        return FSDPModel(model)
    if layout.name == "tp2":
        from diloco.site.layouts.tensor_parallel import TensorParallelModel

        return TensorParallelModel(model)
    if layout.name == "tp2_fsdp2":
        from diloco.site.layouts.tensor_parallel import TensorFSDPModel

        return TensorFSDPModel(model)
    if layout.name == "pp2":
        from diloco.site.layouts.pipeline import PipelineModel

        return PipelineModel(model, microbatches=layout.microbatches)
    raise ValueError(f"layout={layout.name!r}: not built")


def site_group(process_group: Any = None) -> Any:
    """The process group of a site's ranks: ``process_group``, else the whole world when
    torch.distributed is initialised with more than one rank; None for a one-process site."""
    if process_group is not None:
        if not dist.is_initialized():
            raise ValueError("process_group is given but torch.distributed is not initialised (init_process_group first)")
        return process_group if dist.get_world_size(process_group) > 1 else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None
