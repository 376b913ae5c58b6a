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
    """What ``params_sha256`` hashes of a tensor beside its bytes' digest: its name, shape and dtype."""
    return f"{name}|{list(t.shape)}|{t.dtype}|".encode()


def tensor_sha256(t: torch.Tensor) -> bytes:
    """SHA-256 of one tensor's raw bytes (the digest ``params_sha256`` combines)."""
    h = hashlib.sha256()
    t = t.detach().contiguous().cpu()
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy of it
    return h.digest()


def combine_sha256(parts: Mapping[str, tuple[bytes, bytes]]) -> str:
    """``params_sha256`` from each tensor's (tensor_header, tensor_sha256), whoever computed
    them: the same digest however the tensors were split between the processes that hashed them."""
    h = hashlib.sha256()
    for name in sorted(parts):
        header, digest = parts[name]
        h.update(header)
        h.update(digest)
    return h.hexdigest()


def params_sha256(params: Mapping[str, torch.Tensor]) -> str:
    """θ's hash: SHA-256, in name order, over each tensor's name, shape and dtype and the
    SHA-256 of its raw bytes. Two levels, so that a coordinator whose parameters are split by
    range (each part hashing its own tensors) and a caller that writes θ block by block
    (diloco.coordinator.commit_blocks) give the same digest as one pass over the whole θ."""
    parts = {}
    for name in sorted(params):  # each tensor read once, in name order (a rank's gathers: diloco.site.layouts.found)
        t = params[name]
        parts[name] = (tensor_header(name, t), tensor_sha256(t))
    return combine_sha256(parts)


def params_sha256_v1(params: Mapping[str, torch.Tensor]) -> str:
    """θ's hash before 2026-12-08 (one SHA-256 over every tensor's header and bytes, in name
    order): what coordinator checkpoints of formats 1 to 3 recorded. Read only, to check them."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().contiguous().cpu()
        h.update(tensor_header(name, t))
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()
