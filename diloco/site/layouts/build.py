"""Starts a site's process group (under torchrun) and builds its layout."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.site.layouts.base import ParallelModel
from diloco.site.layouts.config import LayoutConfig


def launched_ranks() -> int:
    """The number of processes torchrun started for this site (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)`` that survives torchrun's
    restarts: under torchrun (``--max-restarts``) the group's rendezvous keys go under a prefix
    of the restart attempt, in the store torchrun's agent serves. Torch 2.13 reuses that store
    across restarts without one, so a restarted group finds its dead predecessors' addresses
    and fails (gloo: ``connectFullMesh ... Connection refused``; pytorch/pytorch#167288 for
    NCCL). Outside torchrun (or with ``store=``/``init_method=`` given) it is the plain call."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.get("timeout") or timedelta(minutes=10)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"/diloco/attempt_{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


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
            init_distributed("cpu:gloo,cuda:nccl", device_id=device if on_gpu else None)
        else:
            init_distributed("gloo")


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
