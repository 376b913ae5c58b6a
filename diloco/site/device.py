"""Where a site trains: the device of config ``device`` for one rank, and the CUDA settings."""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """``device=cuda`` where there is no CUDA GPU; the message says what torch sees."""


def resolve_device(name: str, index: int = 0) -> torch.device:
    """``cpu``; ``cuda``: the GPU ``index`` modulo the visible GPUs (a rank's LOCAL_RANK, or a
    simulated site's number, so several sites can share one GPU); ``auto``: cuda when available."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise DeviceError(f"device={name!r}: must be auto, cpu or cuda")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU build)"
        raise DeviceError(f"device=cuda: this machine has no usable CUDA GPU (torch {torch.__version__}, built with {built}); use device=cpu or auto")
    return torch.device("cuda", index % torch.cuda.device_count())


def configure_cuda(device: torch.device, tf32: bool) -> None:
    """Makes ``device`` the current CUDA device (nccl and torch.compile use it) and sets TF32."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def flush_denormals(on: bool) -> bool:
    """Subnormal floats flushed to zero in this process's CPU arithmetic (``inner.flush_denormal``);
    True if the CPU can (x86 with SSE3). A thread's setting is its own and a new thread takes
    its creator's, so this is called at the start of a process, before torch's worker threads
    and the process's own threads exist; every process of a run (sites, coordinator, baselines)
    calls it with the run's setting, so that the outer step's arithmetic is the same on every
    copy of θ."""
    return bool(torch.set_flush_denormal(on))
