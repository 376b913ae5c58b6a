"""Pipeline parallelism (torch.distributed.pipelining) over the ranks of a site: rank i runs
stage i of the blocks, microbatches flow through a 1F1B schedule. The first stage holds the
embedding and the first blocks, the last stage the other blocks, the final norm and the
head; with tied embeddings both hold the embedding matrix, and its gradient is summed over
the two stages after each step (so the copies stay equal).

Each rank pushes and pulls only the parameters of its stage (the tied embedding: pushed by
stage 0, pulled by both)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from diloco.boxes import Box
from diloco.model import lm_loss
from diloco.site.layouts.base import DistributedModel, Held


class _Stage(nn.Module):
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


class PipelineModel(DistributedModel):
    name = "pp"

    def __init__(self, model: nn.Module, microbatches: int = 2) -> None:
        super().__init__(model)
        n_layers = len(model.blocks)
        if n_layers < self.world:
            raise ValueError(f"pipeline parallelism over {self.world} stages needs at least {self.world} blocks; the model has {n_layers}")
        lo, hi = stage_bounds(n_layers, self.world)[self.rank]
        first, last = self.rank == 0, self.rank == self.world - 1
        # Drop what other stages run: this rank's parameters are those of its stage only.
        for i in range(n_layers):
            if not lo <= i < hi:
                model.blocks[i] = nn.Identity()
        if not last:
            model.norm = nn.Identity()
            model.head = None
        self.tied = model.head is None and (first or last)  # the embedding matrix is also the head
        if not first and not self.tied:
            model.tok_emb = nn.Identity()
        self.microbatches = microbatches
        # The group that sums the tied embedding's gradient: the first and the last stage
        # (created by every rank, as torch.distributed requires).
        self._tied_group = dist.new_group([0, self.world - 1]) if self.world > 2 else None
        stage = PipelineStage(_Stage(model, lo, hi, first, last), self.rank, self.world, self.device)
        self._schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lm_loss)

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] % self.microbatches:
            raise ValueError(f"layout pp2: data.batch_size={x.shape[0]} must be a multiple of layout.microbatches={self.microbatches}")
        return x, y  # the first stage feeds x, the last scores against y

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self._schedule.step(x)
        elif self.rank == self.world - 1:
            self._schedule.step(target=y, losses=losses)
        else:
            self._schedule.step()
        if self.tied and self.rank in (0, self.world - 1):
            self._sum_tied_grad()
        loss = torch.stack([x.detach().float() for x in losses]).mean().reshape(1) if losses else torch.zeros(1)
        dist.broadcast(loss, src=self.world - 1)  # every stage reports the batch's loss
        return float(loss.item())

    def _sum_tied_grad(self) -> None:
        w = self.module.tok_emb.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=self._tied_group)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        """The norm over every stage's gradients, the tied embedding counted once."""
        sq = torch.zeros(1, dtype=torch.float64)
        for n, p in self.module.named_parameters():
            if p.grad is not None and not (self.tied and n == "tok_emb.weight" and self.rank != 0):
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq)
        coef = min(1.0, max_norm / (float(sq.sqrt()) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)

    def held(self) -> dict[str, Held]:
        return {n: Held(p.data, Box.whole(p.shape), not (self.tied and n == "tok_emb.weight" and self.rank != 0)) for n, p in self.module.named_parameters()}

    def full_state(self) -> dict[str, torch.Tensor]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, {n: p.detach().clone() for n, p in self.module.named_parameters()})
        return {n: t for part in parts for n, t in part.items()}
