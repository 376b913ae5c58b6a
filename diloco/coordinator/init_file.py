"""init=file: θ₀ from a ``.safetensors`` file or a ``torch.save`` state dict.

A user starting from pretrained weights saves them once (``safetensors.torch.save_file`` or
``torch.save(model.state_dict(), path)``) and points the coordinator at the file; the
coordinator needs no model code. A torch file is loaded with ``weights_only=True`` (no
pickled code runs). Every tensor becomes float32 (θ is kept and averaged in float32; a bf16
checkpoint is widened exactly). Errors name the file and the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

SAFETENSORS_MAGIC_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


class InitFileError(ValueError):
    """``init.path`` cannot give θ₀; the message names the file and what is wrong."""


def load_init_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The named float32 tensors of ``path`` (safetensors, or a torch.save state dict, also
    one nested under a "state_dict" or "model" key)."""
    p = Path(path).expanduser()
    where = f"init.path={path}"
    if not p.is_file():
        raise InitFileError(f"{where}: no such file")
    tensors = _load_safetensors(p, where) if _is_safetensors(p) else _load_torch(p, where)
    if not tensors:
        raise InitFileError(f"{where}: holds no tensors")
    out = {}
    for name, t in sorted(tensors.items()):
        if not isinstance(name, str) or not name:
            raise InitFileError(f"{where}: a tensor has the name {name!r}; names must be non-empty strings")
        if not isinstance(t, torch.Tensor):
            raise InitFileError(f"{where}: {name!r} is a {type(t).__name__}, not a tensor")
        if not t.is_floating_point():
            raise InitFileError(f"{where}: {name!r} is {str(t.dtype).removeprefix('torch.')}; θ₀ holds trainable (floating-point) parameters only")
        t = t.detach().to("cpu", torch.float32).contiguous()
        if not torch.isfinite(t).all():
            raise InitFileError(f"{where}: {name!r} holds {int((~torch.isfinite(t)).sum())} non-finite values")
        out[name] = t
    return out


def _is_safetensors(p: Path) -> bool:
    """A safetensors file starts with the length of its JSON header and then ``{``."""
    with open(p, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= SAFETENSORS_MAGIC_MAX_HEADER and head[8:9] == b"{"


def _load_safetensors(p: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError:
        raise InitFileError(f"{where}: a safetensors file, and the safetensors package is not installed (pip install safetensors)") from None
    try:
        return load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise InitFileError(f"{where}: not a readable safetensors file: {e}") from None


def _load_torch(p: Path, where: str) -> Mapping[str, object]:
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise InitFileError(
            f"{where}: neither a safetensors file nor a torch.save state dict that loads with weights_only=True ({type(e).__name__}: {e})"
        ) from None
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            nested = obj.get(key)
            if isinstance(nested, Mapping) and all(isinstance(v, torch.Tensor) for v in nested.values()):
                return nested
        return obj
    raise InitFileError(f"{where}: holds a {type(obj).__name__}; expected a state dict (a mapping of names to tensors)")
