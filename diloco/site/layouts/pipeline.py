"""Pipeline parallelism (torch.distributed.pipelining) on the ``pp`` dimension of a site's mesh:
the rank at pp coordinate i runs stage i of the built-in transformer's blocks, microbatches flow
through a 1F1B schedule. The first stage holds the embedding and the first blocks, the last
stage the other blocks, the final norm and the head; with tied embeddings both hold the
embedding matrix, and its gradient is summed over the two stages after each step (so the copies
stay equal). What each rank syncs is found from what its stage holds (layouts/found.py): the
stages' names are disjoint but for the tied embedding, which one of its holders pushes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from diloco.model import lm_loss


class Stage(nn.Module):
    """Runs blocks [lo, hi) of ``model``; the first stage starts from token ids, the last ends
    with the norm and the head."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.lo, self.hi, self.first, self.last = model, lo, hi, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        t = x.shape[1]
        if self.first:
            x = m.tok_emb(x)
        cos, sin = m.rope_cos[:t], m.rope_sin[:t]
        for i in range(self.lo, self.hi):
            x = m.blocks[i](x, cos, sin)
        if self.last:
            x = m.norm(x)
            x = F.linear(x, m.tok_emb.weight) if m.head is None else m.head(x)
        return x


def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Blocks [lo, hi) of each stage: as even as possible, earlier stages (which also hold the
    embedding) the smaller ones."""
    base, extra = divmod(n_layers, stages)
    sizes = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    bounds, lo = [], 0
    for n in sizes:
        bounds.append((lo, lo + n))
        lo += n
    return bounds


def cut_stage(model: nn.Module, stage: int, stages: int) -> Stage:
    """Drops from ``model`` what the other stages run (its parameters become this stage's
    only) and returns the module that runs this stage."""
    n_layers = len(model.blocks)
    if n_layers < stages:
        raise ValueError(f"pipeline parallelism over {stages} stages needs at least {stages} blocks; the model has {n_layers}")
    lo, hi = stage_bounds(n_layers, stages)[stage]
    first, last = stage == 0, stage == stages - 1
    for i in range(n_layers):
        if not lo <= i < hi:
            model.blocks[i] = nn.Identity()
    tied = model.head is None
    if not last:
        model.norm = nn.Identity()
        model.head = None
    if not first and not (tied and last):
        model.tok_emb = nn.Identity()
    return Stage(model, lo, hi, first, last)


class Pipeline:
    """The 1F1B schedule of one rank's stage, over the ranks of ``group`` (its pp group: the
    ranks that differ from it in the pp coordinate only, in stage order)."""

    def __init__(self, stage: Stage, index: int, stages: int, microbatches: int, device: torch.device, group: Any, tied_group: Any) -> None:
        self.stage, self.index, self.stages, self.group = stage, index, stages, group
        # the embedding matrix is also the head: its gradient is summed over the first and the last stage
        self.tied = stage.model.head is None and isinstance(stage.model.tok_emb, nn.Embedding) and (stage.first or stage.last)
        self.tied_group = tied_group
        self.last_rank = dist.get_global_rank(group, stages - 1)
        pipe_stage = PipelineStage(stage, index, stages, device, group=group)
        self.schedule = Schedule1F1B(pipe_stage, n_microbatches=microbatches, loss_fn=lm_loss)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if self.stage.first:
            self.schedule.step(x)
        elif self.stage.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        if self.tied:
            w = self.stage.model.tok_emb.weight
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            grad = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
            dist.all_reduce(grad, group=self.tied_group)
        loss = torch.stack([v.detach().float() for v in losses]).mean().reshape(1).cpu() if losses else torch.zeros(1)
        dist.broadcast(loss, src=self.last_rank, group=self.group)  # every stage reports the batch's loss
        return float(loss.item())
