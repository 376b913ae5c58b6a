"""Pseudo-gradients and applying updates to a copy of the global parameters."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def pseudo_gradient(global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = θ_global − θ_local, per parameter, in float32.

    The sign matters: Δ points from the local parameters back to the global ones, like a
    gradient, so an outer SGD step θ − lr·Δ with lr = 1 lands on the local parameters.
    """
    if global_params.keys() != local_params.keys():
        diff = sorted(set(global_params) ^ set(local_params))
        raise KeyError(f"global and local parameters differ in names: {diff[:5]}")
    return {n: global_params[n].detach().float() - local_params[n].detach().float() for n in global_params}


def nonfinite_count(tensors: Mapping[str, torch.Tensor]) -> int:
    """How many values of ``tensors`` are NaN or infinite."""
    return sum(int(t.numel() - int(torch.isfinite(t).sum())) for t in tensors.values())


def apply_update(global_params: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> None:
    """θ += u in place. Sites and the coordinator both call exactly this, so their copies
    of θ stay bit-identical (same operands, same float32 add)."""
    for name, u in update.items():
        global_params[name].add_(u)


def tensor_header(name: str, t: torch.Tensor) -> bytes:
    """What ``params_sha256`` hashes of a tensor before its bytes: its name, shape and dtype."""
    return f"{name}|{list(t.shape)}|{t.dtype}|".encode()


def params_sha256(params: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over name, shape, dtype and raw bytes of each tensor, in name order (a caller
    that writes θ block by block feeds the same bytes as it goes: diloco.coordinator.commit_blocks)."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().contiguous().cpu()
        h.update(tensor_header(name, t))
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy of it
    return h.hexdigest()
