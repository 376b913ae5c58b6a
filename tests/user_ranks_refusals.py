"""Bad multi-rank sites, each refused before its first push: run under torchrun on 2 ranks
(gloo, CPU) against a coordinator that holds θ₀ (the MLP of user_ranks_site.py)::

    torchrun --nproc-per-node=2 tests/user_ranks_refusals.py --coordinator HOST:PORT --out refusals.json

Every case makes ``DiLoCo(...)`` on both ranks the way a mistaken trainer would, and records
what each rank raised (type and message). Rank 0 writes ``{case: [rank 0's, rank 1's]}``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from user_ranks_site import build

from diloco import DiLoCo


def _dtensor_weight(model: nn.Sequential, placement: object) -> nn.Sequential:
    """Layer 0's weight made a DTensor on a mesh of the two ranks with ``placement`` (this
    rank's), its local part cut from the whole weight as the placement says."""
    mesh = init_device_mesh("cpu", (2,))
    whole = model[0].weight.detach()
    local = whole.chunk(2)[dist.get_rank()].clone() if isinstance(placement, Shard) else whole.clone()
    model[0].weight = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=whole.shape, stride=whole.stride()))
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def site(model: nn.Module, **kw: object) -> None:
        given = {"coordinator": args.coordinator, "site_id": "bad", "sync_every": 4, **kw}
        dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **given)  # type: ignore[arg-type]
        with dl:  # joins: the coordinator's checks
            pass

    def without(*layers: int) -> nn.Sequential:
        model = build(0)
        for i in layers:
            model[i] = nn.Identity()
        return model

    # held_by_no_rank first: the only case the coordinator judges, while the run still has a free
    # site slot (the test starts the good sites once it is done: else "all taken" comes first)
    cases: dict[str, Callable[[], None]] = {
        "held_by_no_rank": lambda: site(without(4)),  # the coordinator names what is missing
        "two_site_ids": lambda: site(build(0), site_id=f"site-{rank}"),
        "two_sync_every": lambda: site(build(0), sync_every=4 + rank),
        "shapes_disagree": lambda: site(build(0) if rank == 0 else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))),
        "overlap": lambda: site(_dtensor_weight(build(0), Shard(0) if rank == 0 else Replicate())),
        "gap": lambda: site(_dtensor_weight(build(0), Shard(0)) if rank == 0 else without(0)),
        "partial": lambda: site(_dtensor_weight(build(0), Partial() if rank == 1 else Shard(0))),  # one rank alone
        "fsdp1": lambda: site(FullyShardedDataParallel(build(0), device_id=torch.device("cpu"))),
    }
    out: dict[str, str] = {}
    for name, case in cases.items():
        try:
            case()
            got = "accepted"
        except Exception as e:
            got = f"{type(e).__name__}: {e}"
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, got)
        out[name] = every
        if rank == 0:
            print(f"case {name} done", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
