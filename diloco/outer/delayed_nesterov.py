"""Delayed Nesterov: the outer optimizer of asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135).

Plain Nesterov puts every pseudo-gradient into the momentum at once, so a stale Δ (a late push
merged into a later round) is carried forward by the momentum for ~1/(1-β) rounds as if it were
fresh. Delayed Nesterov updates the momentum only every ``period`` outer steps, with the mean of
the Δs seen since; in between each step is plain gradient descent with lr/period:

    every step:          b ← b + g;  θ ← θ − lr · g / N            (N = period)
    every N-th step:     m ← β·m + b / N;  b ← 0;  θ ← θ − lr · β · m  (folded into the same add)

Over N steps θ moves by −lr · (mean g + β·m_new): one Nesterov step on the mean of the N Δs.
``period=1`` is exactly torch's Nesterov SGD (the same float operations, so bit-identical).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov outer SGD; state per parameter: ``buffer`` (Σ g since the last momentum
    update), ``momentum_buffer`` and ``count`` (steps taken), all saved by ``state_dict``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.9, period: int = 4) -> None:
        if not lr > 0:
            raise ValueError(f"DelayedNesterov: lr={lr} must be > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"DelayedNesterov: momentum={momentum} must be in [0, 1)")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"DelayedNesterov: period={period!r} must be an integer >= 1")
        super().__init__(params, {"lr": lr, "momentum": momentum, "period": period})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("DelayedNesterov.step takes no closure")
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["period"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["count"] = 0
                    state["buffer"] = torch.zeros_like(p)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["count"] += 1
                step = g if n == 1 else g / n
                if state["count"] % n:
                    state["buffer"].add_(g)
                    p.add_(step, alpha=-lr)
                    continue
                mean = g if n == 1 else state["buffer"].add_(g).div_(n)
                m = state["momentum_buffer"]
                if state["count"] == n:
                    m.copy_(mean)  # the first momentum update: m = mean, as torch's SGD does
                else:
                    m.mul_(beta).add_(mean)
                state["buffer"].zero_()
                p.add_(step.add(m, alpha=beta), alpha=-lr)
