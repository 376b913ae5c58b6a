"""Atomic, checksummed checkpoints: a crash never leaves a half-written one in use.

A checkpoint is one file ``ckpt-<round>.pt`` in a directory: a 48-byte header (magic,
format version, payload length, SHA-256 of the payload) followed by the payload, which is
``torch.save`` of a dict of tensors and plain data. Writing goes to a temporary file in the
same directory, is fsynced, renamed over the final name and the directory fsynced, so the
final name only ever holds a complete file. Loading checks the header and the checksum; a
bad file is named in the returned problems and the next older good one is used. The newest
``keep`` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.security.ids import quote

MAGIC = b"DLCK"
VERSION = 1
_HEADER = struct.Struct("<4sIQ32s")  # magic, version, payload length, sha256(payload)
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong."""


@dataclass
class Loaded:
    round: int
    state: dict[str, Any]
    path: Path
    problems: list[str] = field(default_factory=list)  # newer files that were skipped, and why


def checkpoint_path(directory: Path, round: int) -> Path:
    return Path(directory) / f"ckpt-{round:08d}.pt"


def save_checkpoint(directory: Path, round: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Writes ``state`` as the checkpoint of ``round`` atomically; prunes all but the newest ``keep``."""
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = _HEADER.pack(MAGIC, VERSION, len(payload), hashlib.sha256(payload).digest())
    final = checkpoint_path(directory, round)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state in ``path``; CheckpointError naming the file if it is truncated, corrupt or foreign."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if len(data) < _HEADER.size:
        raise CheckpointError(f"{path}: {len(data)} bytes, shorter than the {_HEADER.size}-byte header (truncated)")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a diloco checkpoint (magic {magic!r})")
    if version != VERSION:
        raise CheckpointError(f"{path}: format version {version}; this build reads version {VERSION}")
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(f"{path}: payload has {len(payload)} bytes, the header declares {length} (truncated or padded)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        # torch wraps a refused global in a page of advice (to load the file unsafely) around
        # one line of diagnosis that echoes names from the file: keep that line, bounded.
        why = (str(e).partition("WeightsUnpickler error: ")[2] or str(e)).strip()
        raise CheckpointError(f"{path}: payload does not load: {quote(why.splitlines()[0] if why else type(e).__name__, 200)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a dict of state")
    return state


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest round first (temporary files excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_latest(directory: Path) -> Loaded | None:
    """The newest checkpoint that verifies, with the problems of any newer ones; None if there is none."""
    problems: list[str] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            state = read_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return Loaded(round=int(_NAME.match(path.name).group(1)), state=state, path=path, problems=problems)  # type: ignore[union-attr]
    if problems:
        raise CheckpointError("no usable checkpoint: " + "; ".join(problems))
    return None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
