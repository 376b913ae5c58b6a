"""The inner trainer: AdamW with warmup + cosine, gradient clipping, optional bf16 autocast."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diloco.fields import setting
from diloco.model import lm_loss, model_logits


@dataclass(frozen=True)
class InnerConfig:
    """The ``inner`` section: each site's AdamW, with linear warm-up and cosine decay over the run's rounds × H steps."""

    lr: float = setting(3e-3, doc="AdamW's peak learning rate, reached at the end of the warm-up")
    min_lr_ratio: float = setting(0.1, doc="the cosine decay ends at lr × min_lr_ratio at the last step, in [0, 1]")
    warmup_steps: int = setting(50, doc="inner steps of the linear lr warm-up (0: none)")
    weight_decay: float = setting(0.1, doc="AdamW's weight decay, on matrices only (not on norms' gains or biases)")
    beta1: float = setting(0.9, doc="AdamW's β1")
    beta2: float = setting(0.95, doc="AdamW's β2")
    grad_clip: float = setting(1.0, doc="the largest global gradient norm: gradients above it are scaled down to it; 0: no clipping")
    bf16: bool = setting(False, doc="autocast forward and backward to bfloat16")
    # On the CPU, subnormal floats (the softmax of bytes a confident model rules out) cost x86
    # cores many times an ordinary multiply (scripts/bench_flush_denormal.py); flushing is set
    # for the whole process (diloco.site.device.flush_denormals).
    flush_denormal: bool = setting(
        True, doc="CPU: every process of the run flushes subnormal floats (below 1.2e-38) to zero; without it a confident model's steps took 1.54x as long"
    )

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"inner.lr={self.lr}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"inner.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"inner.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.grad_clip < 0:
            raise ValueError(f"inner.grad_clip={self.grad_clip}: must be >= 0")
        if not isinstance(self.flush_denormal, bool):
            raise ValueError(f"inner.flush_denormal={self.flush_denormal!r}: must be true or false")


def lr_factor(step: int, total_steps: int, cfg: InnerConfig) -> float:
    """Multiplier of cfg.lr at 0-based ``step``: linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms' gains or biases); the fused
    kernel where every parameter is on a GPU (one launch per step instead of one per tensor)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    # The fused multi-tensor (foreach) kernels refuse a mix of plain tensors and DTensors
    # (tensor parallelism leaves norms and embeddings plain), or DTensors on different meshes.
    if _mixes_dtensors(params):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, foreach=False)
    if params and all(p.device.type == "cuda" for p in params):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (the CPU for a model without any)."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _dtensor_class() -> type | None:
    """DTensor, or None while torch.distributed.tensor is not imported: then no tensor can be
    one. (Importing it costs about a second of CPU, which a one-rank site never needs.)"""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _mixes_dtensors(params: list[torch.Tensor]) -> bool:
    """Plain tensors and DTensors together, or DTensors on more than one device mesh."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return False
    return len({id(p.device_mesh) if isinstance(p, dtensor) else None for p in params}) > 1


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, also for a mix of plain tensors and DTensors (on any meshes):
    the norm over the whole (unsharded) gradients, every parameter counted once."""
    if not _mixes_dtensors(params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    dtensor = _dtensor_class()
    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for g in grads:
        n = g.norm()
        squares.append((n.full_tensor() if isinstance(n, dtensor) else n).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.item())
    return total


class InnerTrainer:
    """Runs inner steps on one model; its optimizer state lives as long as the trainer.

    ``total_steps`` is the length of the whole run (rounds × H) for the lr schedule.
    """

    def __init__(self, model: nn.Module, cfg: InnerConfig, total_steps: int, optimizer: torch.optim.Optimizer | None = None, layout: Any = None) -> None:
        self.model = model
        self.layout = layout  # a site layout (diloco.site.layouts): its own forward/backward and clipping
        self.cfg = cfg
        self.total_steps = total_steps
        self.optimizer = optimizer if optimizer is not None else build_inner_optimizer(model, cfg)
        self.steps_done = 0
        self.device = model_device(model)  # batches go where the parameters are

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on a batch; returns the loss in nats per token."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_factor(self.steps_done, self.total_steps, self.cfg)
        self.model.train()
        if x.device != self.device:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        run = self.layout.forward_backward if self.layout is not None else None
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            if run is not None:
                value = run(x, y)
            else:
                loss = lm_loss(model_logits(self.model, x), y)
        if run is None:
            loss.backward()
            value = float(loss.detach())
        if self.cfg.grad_clip > 0:
            params = list(self.model.parameters())
            if self.layout is not None:
                self.layout.clip_grad_norm(params, self.cfg.grad_clip)
            else:
                clip_grad_norm(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return value

    def reset_state(self) -> None:
        """Forgets the optimizer's per-parameter state (AdamW's moments, which a diverged phase
        filled with NaN): the next step starts them afresh. The lr schedule goes on."""
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """Mean held-out loss in nats per token, and the tokens it was measured on (on the
    model's device, in float32)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        total += float(lm_loss(model_logits(model, x), y)) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count, count


def evaluate_bpb(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss in bits per byte (where tokens are bytes, bpb = nats / ln 2)."""
    return evaluate_loss(model, batches)[0] / math.log(2)
