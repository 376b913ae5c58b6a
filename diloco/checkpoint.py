"""Atomic, checksummed checkpoints: a crash never leaves a half-written one in use.

A checkpoint is one file ``ckpt-<round>.pt`` in a directory: a 48-byte header (magic,
format version, payload length, SHA-256 of the payload) followed by the payload. Writing goes
to a temporary file in the same directory, is synced, renamed over the final name and the
directory synced, so the final name only ever holds a complete file. Loading checks the
header and the checksum; a bad file is named in the returned problems and the next older good
one is used. The newest ``keep`` checkpoints are kept.

Format 2 (written since issue 16): the payload is every plain, non-empty CPU tensor of the
state as raw bytes (each 64-byte aligned), then the state's *skeleton* (``torch.save`` of the
state with each of those tensors replaced by a reference ``{"__diloco_raw__": [offset, bytes,
dtype, shape]}``), then the skeleton's length (8 bytes, little-endian). Its checksum is the
SHA-256 of the SHA-256s of its 1 MiB segments, so two threads hash it at once while the
tensors are written straight from memory (no torch.save copy and zip checksums of every
tensor), the skeleton pickled meanwhile. Loading is as safe as before: the skeleton goes through
``torch.load(weights_only=True)``, every reference is checked against the payload before a
tensor is built, and each loaded tensor owns its memory. (Tensors that shared memory when
saved come back as separate copies.) Format 1 files (SHA-256 of the payload, a plain
``torch.save`` of the state) are still read.

Format 3 (issue 37): format 2's layout, its checksum the SHA-256 of the CRC-32s of the 1 MiB
segments instead of their SHA-256s. The checksum finds a torn, truncated or bit-rotted file;
it was never a defence against tampering (whoever can write the checkpoint directory can
write a valid file, checksum and all), and CRC-32 finds those accidents as surely, at 2.5x
SHA-256's speed on one core (4.2 against 1.7 GB/s measured here): the coordinator writes θ,
its momentum and its residual (12 bytes per parameter) every round, and hashing them was its
largest CPU cost per round. Format 2 files are still read.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import math
import os
import re
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.security.ids import quote

MAGIC = b"DLCK"
VERSION = 3  # the format this build writes; it reads 1, 2 and 3
_READS = (1, 2, 3)
_RAW_KEY = "__diloco_raw__"
_ALIGN = 64
_LENGTH = struct.Struct("<Q")
_SEGMENT = 1 << 20  # format 2 hashes the payload in segments of this many bytes
_SPARE = ".ckpt-spare"  # the last checkpoint pruned, kept to be written over by the next
_RAW_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}
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
    raw: list[tuple[int, memoryview]] = []
    skeleton = _skeleton(state, raw)
    tensors = _tensor_section(raw)
    final = checkpoint_path(directory, round)
    fd, tmp = _scratch_file(directory, final)
    try:
        try:
            # The tensors' bytes go to the file on another thread, which then helps hash them:
            # the digest is over 1 MiB segments (_Segments), hashed by both threads at once
            # (hashing and writing release the GIL). Meanwhile this one adds the skeleton; the
            # header, which holds the digest, goes in front last, and one sync makes the whole
            # file durable.
            segments = _Segments(VERSION)
            segments.add(tensors)
            at = _HEADER.size + sum(len(p) for p in tensors)
            writer = _Background(lambda: (_write_pieces(fd, tensors, _HEADER.size), segments.hash_ready()))
            try:
                segments.hash_ready()
                buf = io.BytesIO()
                torch.save(skeleton, buf)
                tail = [buf.getbuffer(), memoryview(_LENGTH.pack(buf.tell()))]
                segments.add(tail, last=True)
                _write_pieces(fd, tail, at)
                segments.hash_ready()
            finally:
                writer.join()
            segments.hash_ready()
            length = at - _HEADER.size + sum(len(p) for p in tail)
            _pwrite_all(fd, _HEADER.pack(MAGIC, VERSION, length, segments.digest()), 0)
            if os.fstat(fd).st_size > _HEADER.size + length:  # a recycled file that was longer
                os.ftruncate(fd, _HEADER.size + length)
            _datasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    _discard(list_checkpoints(directory)[:-keep])
    return final


def _scratch_file(directory: Path, final: Path) -> tuple[int, str]:
    """A hidden file to write the checkpoint into before it takes its name: the spare (the last
    checkpoint pruned, renamed away) when there is one, else a new one. Writing over a file
    whose blocks are allocated makes the sync about twice as fast (no new blocks to allocate
    and journal); its old content is all overwritten, or cut off, before it is renamed."""
    tmp = directory / f".{final.name}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        os.replace(directory / _SPARE, tmp)
        return os.open(tmp, os.O_WRONLY), str(tmp)
    except OSError:  # no spare (or one that cannot be written over): a new file
        with contextlib.suppress(OSError):
            if Path(tmp).is_file():
                Path(tmp).unlink()
        return tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)


def _crc32(views: list[memoryview]) -> bytes:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)  # releases the GIL for buffers this large
    return crc.to_bytes(4, "little")


def _sha256(views: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for view in views:
        h.update(view)
    return h.digest()


_SEGMENT_SUMS = {2: _sha256, 3: _crc32}  # format -> each segment's checksum


class _Segments:
    """The payload, as it is added, cut into _SEGMENT-byte segments; each complete segment
    is checksummed by whichever thread calls ``hash_ready`` (several may, at once). The digest
    (formats 2 and 3): SHA-256 over the segments' checksums, in order: their SHA-256s (format
    2) or CRC-32s (format 3)."""

    def __init__(self, version: int) -> None:
        self._sum = _SEGMENT_SUMS[version]
        self._segments: list[list[memoryview]] = [[]]
        self._room = _SEGMENT
        self._ready = 0  # segments complete (all but the last, until the payload's end is added)
        self._next = 0  # the next segment to hash
        self._digests: list[bytes | None] = []
        self._lock = threading.Lock()

    def add(self, pieces: list[memoryview], last: bool = False) -> None:
        with self._lock:
            for piece in pieces:
                piece = piece.cast("B") if piece.format != "B" else piece
                while len(piece):
                    take = piece[: self._room]
                    self._segments[-1].append(take)
                    piece, self._room = piece[len(take) :], self._room - len(take)
                    if self._room == 0:
                        self._segments.append([])
                        self._room = _SEGMENT
            if last and not self._segments[-1]:
                self._segments.pop()
            self._ready = len(self._segments) if last else len(self._segments) - 1
            self._digests += [None] * (self._ready - len(self._digests))

    def hash_ready(self) -> None:
        while True:
            with self._lock:
                if self._next >= self._ready:
                    return
                i, self._next = self._next, self._next + 1
                views = self._segments[i]
            self._digests[i] = self._sum(views)

    def digest(self) -> bytes:
        assert self._ready == len(self._segments) and all(d is not None for d in self._digests), "every segment added and hashed first"
        return hashlib.sha256(b"".join(self._digests)).digest()  # type: ignore[arg-type]


def _tree_digest(payload: memoryview, version: int = VERSION) -> bytes:
    """The checksum of ``payload`` in format ``version`` (2 or 3; see _Segments)."""
    segments = _Segments(version)
    segments.add([payload], last=True)
    segments.hash_ready()
    return segments.digest()


def _tensor_section(raw: list[tuple[int, memoryview]]) -> list[memoryview]:
    """The raw tensors' bytes at their offsets (zero padding between them): the payload's start."""
    pieces: list[memoryview] = []
    end = 0
    for offset, data in raw:
        if offset > end:
            pieces.append(memoryview(bytes(offset - end)))
        pieces.append(data)
        end = offset + len(data)
    return pieces


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _skeleton(obj: Any, raw: list[tuple[int, memoryview]]) -> Any:
    """``obj`` with its plain CPU tensors replaced by references to their bytes, which are
    appended to ``raw`` as (offset in the tensor section, bytes)."""
    if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided and not obj.requires_grad:
        name = str(obj.dtype).removeprefix("torch.")
        if name in _RAW_DTYPES and obj.numel():
            data = obj.contiguous().reshape(-1).view(torch.uint8).numpy().data
            offset = _aligned(raw[-1][0] + len(raw[-1][1])) if raw else 0
            raw.append((offset, data))
            return {_RAW_KEY: [offset, len(data), name, list(obj.shape)]}
        return obj
    if type(obj) in (dict, collections.OrderedDict):
        if _RAW_KEY in obj:
            raise ValueError(f"a checkpoint's state may not hold the key {_RAW_KEY!r}")
        return type(obj)((k, _skeleton(v, raw)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v, raw) for v in obj)
    return obj


class _BadReference(ValueError):
    pass


def _restore_raw(obj: Any, tensors: memoryview) -> Any:
    """The skeleton with every reference replaced by its tensor, each checked against the
    payload's tensor section first (a copy of its bytes: the tensor owns its memory)."""
    if type(obj) in (dict, collections.OrderedDict):
        if _RAW_KEY in obj:
            return _raw_tensor(obj, tensors)
        return type(obj)((k, _restore_raw(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_restore_raw(v, tensors) for v in obj)
    return obj


def _raw_tensor(ref: dict[Any, Any], tensors: memoryview) -> torch.Tensor:
    spec = ref[_RAW_KEY]
    if len(ref) != 1 or type(spec) is not list or len(spec) != 4:
        raise _BadReference("a tensor reference is malformed")
    offset, size, name, shape = spec
    dtype = _RAW_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise _BadReference("a tensor reference names no known dtype")
    if type(offset) is not int or type(size) is not int or type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise _BadReference("a tensor reference is malformed")
    numel = math.prod(shape)
    if offset < 0 or size != numel * dtype.itemsize or offset + size > len(tensors):
        raise _BadReference(f"a tensor reference ({size} bytes at {offset}) does not fit the payload or its shape")
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(tensors, dtype=torch.uint8, count=size, offset=offset).clone().view(dtype).reshape(shape)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The state in ``path``; CheckpointError naming the file if it is truncated, corrupt or foreign."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
            del data[got:]
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    if len(data) < _HEADER.size:
        raise CheckpointError(f"{path}: {len(data)} bytes, shorter than the {_HEADER.size}-byte header (truncated)")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a diloco checkpoint (magic {magic!r})")
    if version not in _READS:
        raise CheckpointError(f"{path}: format version {version}; this build reads versions {', '.join(map(str, _READS))}")
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(f"{path}: payload has {len(payload)} bytes, the header declares {length} (truncated or padded)")
    if (hashlib.sha256(payload).digest() if version == 1 else _tree_digest(payload, version)) != digest:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupt)")
    skeleton, tensors_end = payload, 0
    if version >= 2:  # the tensors, the skeleton, the skeleton's length
        size = _LENGTH.unpack_from(payload, len(payload) - _LENGTH.size)[0] if len(payload) >= _LENGTH.size else -1
        if not 0 <= size <= len(payload) - _LENGTH.size:
            raise CheckpointError(f"{path}: payload does not load: its skeleton's length does not fit the payload")
        tensors_end = len(payload) - _LENGTH.size - size
        skeleton = payload[tensors_end : len(payload) - _LENGTH.size]
    try:
        state = torch.load(io.BytesIO(skeleton), weights_only=True)
        if version >= 2:
            state = _restore_raw(state, payload[:tensors_end])
    except _BadReference as e:
        raise CheckpointError(f"{path}: payload does not load: {e}") from None
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


class _Background:
    """``fn()`` on another thread; ``join`` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised by join
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-write", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _write_pieces(fd: int, pieces: list[memoryview], offset: int) -> None:
    for piece in pieces:
        _pwrite_all(fd, piece, offset)
        offset += len(piece)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of ``data`` to ``fd`` at ``offset`` (a raw write may be partial)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"write to a checkpoint file made no progress ({len(view)} bytes left)")
        view = view[n:]
        offset += n


def _discard(paths: list[Path]) -> None:
    """Pruning: each old checkpoint is renamed away at once (it leaves the listing): the oldest
    becomes the spare the next save writes over, unless there is one; the others are deleted
    by a background thread (freeing a large file takes milliseconds). A crash in between
    leaves a hidden ``.old`` file, removed by a later pruning in the same directory."""
    if not paths:
        return
    directory = paths[0].parent
    if not (directory / _SPARE).exists():
        try:
            os.replace(paths[0], directory / _SPARE)  # the next save writes over it
            paths = paths[1:]
        except FileNotFoundError:
            pass
    trash = []
    for p in paths:
        gone = p.with_name(f".{p.name}.old")
        try:
            os.replace(p, gone)
        except FileNotFoundError:
            continue
        trash.append(gone)
    trash += [p for p in directory.glob(".ckpt-*.pt.old") if p not in trash]
    if not trash:
        return

    def delete() -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread only, at the lowest priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for p in trash:
            p.unlink(missing_ok=True)

    threading.Thread(target=delete, name="checkpoint-prune", daemon=True).start()


def _datasync(fd: int) -> None:
    """The file's data and what is needed to read it back (its size) on disk."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
