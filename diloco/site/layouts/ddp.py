"""Data parallel replicas (DistributedDataParallel): every rank holds the whole model, so the
ranks split the tensors between them and each pushes and pulls only its own; after a pull
each owner broadcasts its tensors to the other replicas (inside the site)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from diloco.boxes import Box
from diloco.site.layouts.base import DistributedModel, Held


def split_by_size(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Owner rank of each tensor: largest first, each to the least loaded rank (ties: lowest
    rank), so every rank sends about the same number of bytes. Deterministic."""
    load = [0] * ranks
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(ranks), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += sizes[name]
    return owner


class DDPModel(DistributedModel):
    name = "ddp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.model = DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None)
        self._params = dict(model.named_parameters())
        self.owner = split_by_size({n: p.numel() for n, p in self._params.items()}, self.world)

    def held(self) -> dict[str, Held]:
        return {n: Held(p.data, Box.whole(p.shape), True) for n, p in self._params.items() if self.owner[n] == self.rank}

    def after_pull(self) -> None:
        with torch.no_grad():
            for n in sorted(self._params):
                dist.broadcast(self._params[n].data, src=self.owner[n])
