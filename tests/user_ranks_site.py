"""A user's own multi-rank trainer made a DiLoCo site: a small MLP the project does not know,
parallelised with plain torch.distributed, every rank making the same ``DiLoCo(...)`` call.
Run by the tests under torchrun (gloo, CPU), or alone for a one-process site::

    torchrun --nproc-per-node=2 tests/user_ranks_site.py --parallel fsdp --coordinator HOST:PORT \
        --site-id a --out result.json

``--parallel``: ``none`` (one process), ``ddp`` (DistributedDataParallel, the wrapper given to
DiLoCo), ``fsdp`` (FSDP2 ``fully_shard``), ``tp`` (``parallelize_module``: layer 0 column-,
layer 2 row-wise), ``tp_fsdp`` (a 2-D mesh, dp_shard 2 x tp 2, on 4 ranks), ``hsdp_tp`` (a 3-D
mesh on 8 ranks: HSDP, dp_replicate 2 x dp_shard 2, over tp 2) or ``pp`` (two
pipeline stages by hand: rank 0 holds layers 0-3, rank 1 layer 4, activations sent between).

After every round each rank gathers the model's whole θ (``full_tensor()``, the stages'
union) and hashes it; rank 0 writes those hashes, the site's θ hash and each rank's bytes to
``--out``. ``--kill-rank R --kill-round K``: rank R SIGKILLs itself in round K of its first
incarnation (torchrun restarts the group, which joins again).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from diloco import DiLoCo, init_distributed
from diloco.outer import params_sha256

D_IN = 16


def build(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def parallelise(model: nn.Sequential, how: str) -> tuple[nn.Module, int, int]:
    """The model as the trainer runs it, this rank's data-parallel index and their number
    (the ranks of a tensor-parallel group share one index: they train on the same samples)."""
    if how == "none":
        return model, 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), rank, world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if how == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rank, world
    if how == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), plan)
        return model, 0, 1  # every tp rank trains on the whole batch
    if how == "tp_fsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    if how == "hsdp_tp":  # a 3-D mesh on 8 ranks: HSDP (replicate 2 x shard 2) over tensor parallel 2
        mesh = init_device_mesh("cpu", (2, 2, world // 4), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh["dp_replicate", "dp_shard"]
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=dp)
        fully_shard(model, mesh=dp)
        return model, rank // 2, world // 2
    if how == "pp":
        for i in range(5):
            if (i < 4) != (rank == 0):
                model[i] = nn.Identity()  # this stage does not hold layer i: its names are the other stage's
        return model, 0, 1
    raise SystemExit(f"--parallel {how}: unknown")


def whole_state(model: nn.Module, distributed: bool) -> dict[str, torch.Tensor]:
    """The model's whole θ on every rank: DTensors gathered, pipeline stages united."""
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "module", model)
    mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in inner.named_parameters()}
    if not distributed:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: t for part in every for n, t in part.items()}


def step(model: nn.Module, how: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """One forward and backward; the loss where this rank has it (pp: the last stage)."""
    if how != "pp":
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    if dist.get_rank() == 0:
        h = model(x)
        dist.send(h.detach(), dst=1)
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
        return None
    h = torch.empty(x.shape[0], 64)
    dist.recv(h, src=0)
    h.requires_grad_(True)
    loss = nn.functional.mse_loss(model(h), y)
    loss.backward()
    assert h.grad is not None
    dist.send(h.grad, dst=0)
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", default="none")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--site-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--codec", default=None)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-round", type=int, default=-1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)  # a rank waiting for ever says where, and ends

    distributed = args.parallel != "none"
    if distributed:
        init_distributed("gloo")  # init_process_group that survives torchrun's restarts
    rank = dist.get_rank() if distributed else 0
    model, dp, dps = parallelise(build(args.seed), args.parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w = torch.randn(D_IN, 1, generator=torch.Generator().manual_seed(1234))  # the task: y = x·w
    data = torch.Generator().manual_seed(1000 * args.seed + dp)  # each data-parallel rank its own samples
    hashes, losses = {}, []
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    t0 = time.perf_counter()
    with DiLoCo(model, optimizer, coordinator=args.coordinator, site_id=args.site_id, sync_every=args.sync_every, codec=args.codec) as dl:
        hashes["start"] = params_sha256(whole_state(model, distributed))
        while not dl.finished:
            x = torch.randn(args.batch // dps, D_IN, generator=data)
            y = x @ w
            loss = step(model, args.parallel, x, y)
            if loss is not None:
                counts = args.parallel not in ("tp", "tp_fsdp", "hsdp_tp") or rank % 2 == 0  # one rank per tensor-parallel group counts the samples
                dl.record_loss(loss, tokens=x.shape[0] if counts else 0)
                losses.append(float(loss))
            if first_life and rank == args.kill_rank and dl.round == args.kill_round and dl._steps_in_round == dl.sync_every - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # in the round's last step, before its push
            before = dl.round
            optimizer.step()
            optimizer.zero_grad()
            if dl.round != before:  # a round ended: the model holds the new global θ
                hashes[str(before)] = params_sha256(whole_state(model, distributed))
        site_hash = dl.global_sha256()
        per_rank = dl.layout.gather_objects(
            {
                "bytes_up": dl.sync.stats.bytes_up,
                "bytes_down": dl.sync.stats.bytes_down,
                "pushed": sum(h.box.numel for h in dl.layout.held().values()),
                "timings": dl.sync.stats.timings,
            }
        )
    result = {
        "round_sha256": hashes,
        "global_sha256": site_hash,
        "losses": losses,
        "rounds": dl.round,
        "ranks": per_rank,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "wall_s": time.perf_counter() - t0,
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
