"""The compiled loops of the coordinator's commit (diloco/codec/_int8_native.c) and the one
L2 norm both of its paths measure with.

``norm`` is the coordinator's: float32 tensors through the compiled ``sumsq_f32`` (16 float64
lanes per tensor, added in a fixed order), which the blockwise commit
(diloco.coordinator.commit_blocks) reproduces block by block while it computes the values;
diloco.outer.l2 where the loops were not compiled. The two agree up to float64 rounding.

``available()``: the loops are compiled and give, on this machine, exactly the bits of
torch's outer step (checked once per process on a few small tensors against torch's own
SGD, mean and error feedback, odd lengths and special values included): only then does the
coordinator commit block by block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from diloco.outer import l2

try:
    from diloco.codec import _int8_native
except ImportError:  # not compiled (setup.py makes it optional): torch's paths
    _int8_native = None

native: Any = _int8_native if hasattr(_int8_native, "outer_pass") else None


LANES = 16  # sumsq_f32's lanes: element i of a tensor goes to lane i % LANES


def lanes() -> np.ndarray:
    """A tensor's float64 lanes of squares, zero."""
    return np.zeros(LANES, dtype=np.float64)


def squares(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's sum of squares, as ``norm`` adds them (inf or nan where a value is): a
    norm's parts, which ``root`` adds in the mapping's order to ``norm``'s value; a coordinator
    cut by parameter range adds its shards' parts so, in name order."""
    if native is None or not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors.values()):
        return {n: l2({n: t}) ** 2 for n, t in tensors.items()}
    out = {}
    for n, t in tensors.items():
        acc = lanes()
        if t.numel():
            native.sumsq_f32(t.detach().contiguous().view(-1).numpy(), acc)
        out[n] = native.lanes_sum(acc)
    return out


def root(squares: Iterable[float]) -> float:
    """The square root of the squares added in order: ``norm``'s total."""
    total = 0.0
    for s in squares:
        total += s
    return math.sqrt(total)


def norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over all tensors, in float64 (inf or nan when any value is): the square
    root of the sum, in the mapping's order, of each tensor's lanes added (``lanes_sum``)."""
    if native is None or not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors.values()):
        return l2(tensors)
    total = 0.0
    for t in tensors.values():
        acc = lanes()
        if t.numel():
            native.sumsq_f32(t.detach().contiguous().view(-1).numpy(), acc)
        total += native.lanes_sum(acc)
    return math.sqrt(total)


@functools.cache
def available() -> bool:
    """The compiled loops exist and reproduce torch's outer step here, bit for bit."""
    return native is not None and _agrees_with_torch()


def _agrees_with_torch() -> bool:
    g = torch.Generator().manual_seed(20261207)
    # Finite values only: a round with a value that is not finite is refused before anything
    # is written, and a NaN's bits may differ where an addition's operands were swapped.
    special = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-30, 3e30, -2e30, 65504.0, 1.0, -1.0])
    for n, mu, lr, beta in ((1, 0.9, 0.7, 1.0), (37, 0.5, 1.3, 1.0), (1000, 0.9, 0.7, 0.8), (4099, 0.123, 0.01, 1.0)):
        weight = 3.0 + n
        sums = torch.randn(n, generator=g, dtype=torch.float64).mul_(0.01 * weight)
        theta, buf, resid = (torch.randn(n, generator=g).mul_(scale) for scale in (0.02, 0.01, 1e-4))
        k = min(n, len(special))
        theta[:k], sums[:k] = special[:k], special.flip(0)[:k].double() * weight
        mean = torch.div(sums, weight, out=torch.empty(n, dtype=torch.float32))
        for first in (True, False):
            p = theta.clone()
            opt = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=True)
            if not first:
                opt.state[p]["momentum_buffer"] = buf.clone()
            p.grad = mean.clone()
            opt.step()
            x, mom = torch.empty(n), buf.clone() if not first else torch.empty(n)
            native.outer_pass(
                sums.numpy(), weight, mom.numpy(), 1 if first else 2, True, mu, -lr, theta.numpy(), resid.numpy(), beta, x.numpy(), None, None, 0, None
            )
            u = p - theta
            want = u + resid if beta == 1.0 else u + beta * resid
            if not (_same(x, want) and _same(mom, opt.state[p]["momentum_buffer"])):
                return False
        plain = theta.clone()  # a momentum of 0 (a momentum warm-up's first step): the gradient itself
        plain.add_(mean, alpha=-lr)
        native.outer_pass(sums.numpy(), weight, None, 0, False, 0.0, -lr, theta.numpy(), None, 1.0, x.numpy(), None, None, 0, None)
        sent = torch.randn(n, generator=g).mul_(1e-3)
        applied, left = theta.clone(), torch.empty(n)
        native.outer_apply(x.numpy(), sent.numpy(), applied.numpy(), left.numpy(), None)
        if not (_same(x, plain - theta) and _same(applied, theta + sent) and _same(left, x - sent)):
            return False
    return True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals a NaN of the same bits; -0.0 differs from 0.0)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))
