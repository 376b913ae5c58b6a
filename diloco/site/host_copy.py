"""Moving a site's parameters between the device it trains on and host memory.

The site's copy of the global θ, Δ and everything the wire needs live on the host (as
torchft's backup device does): that costs no GPU memory, and the hash, the codecs and the
float32 arithmetic that keeps every copy bit-identical run exactly as on a CPU site. On a
CUDA site the host tensors are pinned, so the copies each way are asynchronous DMA that
the site waits for once per direction, not once per tensor. On a CPU site nothing is copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class HostMirror:
    def __init__(self) -> None:
        self._staging: dict[str, torch.Tensor] = {}  # pinned buffers for device -> host copies, reused every round

    @staticmethod
    def on_device(tensors: Mapping[str, torch.Tensor]) -> bool:
        return any(t.device.type != "cpu" for t in tensors.values())

    def host(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The values of ``tensors`` on the host: the tensors themselves where they are on the
        CPU, else pinned copies (into buffers kept for the next round)."""
        if not self.on_device(tensors):
            return dict(tensors)
        out = {}
        for name, t in tensors.items():
            buf = self._staging.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._staging[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t.detach(), non_blocking=True)
            out[name] = buf
        _synchronize(tensors)
        return out

    @staticmethod
    def keep(tensors: Mapping[str, torch.Tensor], for_device: bool) -> dict[str, torch.Tensor]:
        """Host tensors to keep for the run (the site's θ): pinned when they feed a device."""
        if not for_device:
            return dict(tensors)
        return {n: t if t.is_pinned() else t.pin_memory() for n, t in tensors.items()}

    @staticmethod
    def load(targets: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
        """targets[n].copy_(values[n]) for every name, asynchronous to a device, then waits."""
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(values[name], non_blocking=True)
        _synchronize(targets)


def _synchronize(tensors: Mapping[str, torch.Tensor]) -> None:
    for device in {t.device for t in tensors.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
