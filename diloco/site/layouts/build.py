"""Starts a site's process group (under torchrun) and builds its model from the degrees of
parallelism, one code path for every layout (the names are shorthands for degrees):

- one device mesh over the site's ranks, with a named dimension per degree above 1, outermost
  first: pp, dp_replicate, dp_shard, tp (torchtitan's order: tensor parallelism innermost);
- pipeline stages on pp (the built-in transformer cut into stages, a 1F1B schedule);
- tensor parallelism on tp (the built-in transformer's plan, or model.parallelize's);
- data parallelism: FSDP2 fully_shard on dp_shard, HSDP (a 2-D mesh) with dp_replicate too;
  dp_replicate alone is DistributedDataParallel, or (with tp or pp) FSDP2's replicate;
- what each rank syncs is found from what it then holds (FoundModel, layouts/found.py), the same
  code that serves a user's own trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.site.layouts.base import DistributedModel, Held, ParallelModel
from diloco.site.layouts.config import DIMS, ParallelDims

Parallelize = Callable[[nn.Module, Any], Any]


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


def init_site_group(dims: ParallelDims, device: torch.device | None = None) -> ParallelDims:
    """Joins the site's process group, after checking that torchrun started as many ranks as
    the degrees need; returns the degrees for those ranks (dp_shard=-1 filled in). Collectives
    on CPU tensors go over gloo, on GPU tensors (where there is a GPU) over nccl: torch picks
    per tensor. ``device``: the rank's GPU, bound to the group so nccl needs no guess."""
    dims = dims.for_ranks(launched_ranks())
    if dims.ranks != 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            on_gpu = device is not None and device.type == "cuda"
            init_distributed("cpu:gloo,cuda:nccl", device_id=device if on_gpu else None)
        else:
            init_distributed("gloo")
    return dims


def close_site_group() -> None:
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective
        dist.destroy_process_group()


def build_layout(dims: ParallelDims, model: nn.Module, parallelize: Parallelize | None = None) -> ParallelModel:
    """``model`` laid out by ``dims`` (resolved for the site's ranks: init_site_group's);
    every rank passes the same freshly built model. ``parallelize(model, mesh)``: applies
    tensor parallelism over ``mesh["tp"]`` (default: the built-in transformer's plan)."""
    if dims.activation_checkpointing:
        from diloco.site.layouts.checkpointing import checkpoint_blocks

        checkpoint_blocks(model)
    if dims.ranks == 1:
        return ParallelModel(model)
    return MeshModel(model, dims, parallelize)


class MeshModel(DistributedModel):
    """A model parallelised over the site's device mesh by its degrees; held(), after_pull()
    and full_state() are a FoundModel's over the site's ranks."""

    def __init__(self, model: nn.Module, dims: ParallelDims, parallelize: Parallelize | None = None) -> None:
        super().__init__(model)
        if dims.ranks != self.world:
            raise ValueError(f"{dims.describe()} needs {dims.ranks} ranks; the site's group has {self.world}")
        from torch.distributed.device_mesh import init_device_mesh

        from diloco.site.layouts.found import FoundModel

        self.dims, self.name = dims, dims.name
        self.coords = dims.coordinates(self.rank)
        # The data-parallel group this rank is in (its ranks train on the same share of a batch).
        self.dp_rank = self.coords["dp_replicate"] * dims.dp_shard + self.coords["dp_shard"]
        used = tuple(d for d in DIMS if getattr(dims, d) > 1)
        self.mesh = init_device_mesh(self.device.type, tuple(getattr(dims, d) for d in used), mesh_dim_names=used)
        runs: nn.Module = model  # what runs forward (a pipeline stage runs part of it)
        stage = None
        if dims.pp > 1:
            from diloco.site.layouts.pipeline import cut_stage

            stage = runs = cut_stage(model, self.coords["pp"], dims.pp)
        if dims.tp > 1:
            if parallelize is None:
                from diloco.site.layouts.tensor_parallel import tensor_parallel

                parallelize = tensor_parallel
            parallelize(model, self.mesh)
        self.model = self._data_parallel(model, runs, stage is not None)
        self.pipeline = None
        if stage is not None:
            from diloco.site.layouts.pipeline import Pipeline

            self.pipeline = Pipeline(stage, self.coords["pp"], dims.pp, dims.microbatches, self.device, self.mesh["pp"].get_group(), self._tied_group())
            self.forward_backward = self.pipeline.forward_backward
        self.found = FoundModel(model, group=dist.group.WORLD)
        self.module, self.specs = self.found.module, self.found.specs

    def _data_parallel(self, model: nn.Module, runs: nn.Module, staged: bool) -> nn.Module:
        """Shards or replicates ``runs`` (the model, or this rank's pipeline stage) over the
        data-parallel dimensions; returns what the trainer runs."""
        dims = self.dims
        blocks = [b for b in getattr(model, "blocks", []) if not isinstance(b, nn.Identity)]
        if dims.dp_shard > 1:
            from diloco.site.layouts.fsdp import shard

            names = ("dp_replicate", "dp_shard") if dims.dp_replicate > 1 else ("dp_shard",)
            shard(runs, blocks, self.mesh[names])
            return model
        if dims.dp_replicate == 1:
            return model
        if dims.tp == 1 and not staged:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None)
        # Replicas of a tensor-parallel model or of a pipeline stage: FSDP2's replicate (DDP on
        # the dp_replicate dimension that composes with DTensors and pipeline schedules).
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in blocks:
            replicate(block, mesh=self.mesh["dp_replicate"])
        replicate(runs, mesh=self.mesh["dp_replicate"])
        return model

    def _tied_group(self) -> Any:
        """The group that sums a tied embedding's gradient: the first and the last stage of
        each pipeline (every rank makes every one of them, in one order); this rank's, or None."""
        dims, mine = self.dims, None
        others = [d for d in DIMS if d != "pp"]
        sizes = [getattr(dims, d) for d in others]
        for flat in range(dims.ranks // dims.pp):  # type: ignore[operator]
            at, rest = {}, flat
            for d, n in zip(reversed(others), reversed(sizes), strict=True):
                at[d], rest = rest % n, rest // n
            ranks = [self._rank_at({**at, "pp": 0}), self._rank_at({**at, "pp": dims.pp - 1})]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for d in DIMS:
            rank = rank * getattr(self.dims, d) + coords[d]
        return rank

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's data-parallel group's share (its tp ranks and pipeline stages share it)."""
        n = self.dims.dp
        if x.shape[0] % n:
            raise ValueError(f"{self.dims.describe()}: data.batch_size={x.shape[0]} must be a multiple of its {n} data-parallel groups")
        if self.pipeline is not None and (x.shape[0] // n) % self.dims.microbatches:
            raise ValueError(
                f"{self.dims.describe()}: each data-parallel share of data.batch_size={x.shape[0]} must be a multiple of parallel.pp_microbatches={self.dims.microbatches}"
            )
        return x.chunk(n)[self.dp_rank], y.chunk(n)[self.dp_rank]

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        """The norm of the whole model's gradient: each distinct box's gradient counted once
        (by the rank that pushes it), summed over the site's ranks."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for n in self.held():
            grad = self.found.param(n).grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                sq += local.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        coef = min(1.0, max_norm / (float(sq.sqrt()) + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)

    def held(self) -> dict[str, Held]:
        return self.found.held()

    def after_pull(self) -> None:
        self.found.after_pull()

    def full_state(self) -> dict[str, torch.Tensor]:
        return self.found.full_state()


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
