"""Tests for data.format=tokens: a flat binary token file, memory-mapped, split and sharded as views."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import diloco.data as data_module
from diloco.data import (
    Corpus,
    DataConfig,
    DataError,
    ShardSampler,
    TokenView,
    eval_batches,
    load_corpus,
)

pytestmark = pytest.mark.timeout(60)

CONTEXT = 16


def write_tokens(path: Path, ids: np.ndarray | list[int], dtype: str) -> Path:
    """nanoGPT's format: the ids, back to back, nothing else."""
    np.array(ids, dtype=dtype).tofile(path)
    return path


def positions_corpus(tmp_path: Path, n: int, dtype: str = "uint32", **cfg: object) -> tuple[DataConfig, Path]:
    """A token file whose token at file position i is i, so every value read names where it came from."""
    path = write_tokens(tmp_path / f"positions.{dtype}.bin", np.arange(n), dtype)
    return DataConfig(path=str(path), format="tokens", dtype=dtype, vocab_size=n, **cfg), path  # type: ignore[arg-type]


def sampler(train: torch.Tensor | TokenView, shard: int, seed: int, num_shards: int = 3, batch_size: int = 8) -> ShardSampler:
    return ShardSampler(train, shard=shard, num_shards=num_shards, batch_size=batch_size, context=CONTEXT, seed=seed)


def all_positions(view: TokenView) -> np.ndarray:
    return view.file_positions(np.arange(view.numel()))


def test_vocab_is_256_for_bytes_and_vocab_size_for_tokens(tmp_path: Path) -> None:
    assert DataConfig().vocab == 256
    cfg, _ = positions_corpus(tmp_path, 4000)
    assert cfg.vocab == 4000
    assert load_corpus(cfg, CONTEXT).vocab_size == 4000


@pytest.mark.parametrize(("text_shards", "every"), [(3, 20), (300, 2)])
def test_tokens_split_and_sample_exactly_like_the_same_bytes(tmp_path: Path, text_shards: int, every: int) -> None:
    """The views implement the bytes rule: same split, same shards, same batches, same eval windows."""
    text = "".join(f"line {i:06d}\n" for i in range(2500)).encode()  # 30000 bytes
    (tmp_path / "text.txt").write_bytes(text)
    as_bytes = load_corpus(DataConfig(path=str(tmp_path / "text.txt"), heldout_every=every), CONTEXT, text_shards)
    path = write_tokens(tmp_path / "text.bin", np.frombuffer(text, dtype=np.uint8), "uint16")
    cfg = DataConfig(path=str(path), format="tokens", dtype="uint16", vocab_size=256, heldout_every=every)
    as_tokens = load_corpus(cfg, CONTEXT, text_shards)
    assert isinstance(as_tokens.train, TokenView) and isinstance(as_tokens.heldout, TokenView)
    for mine, theirs in ((as_tokens.train, as_bytes.train), (as_tokens.heldout, as_bytes.heldout)):
        assert mine.numel() == theirs.numel()
        assert torch.equal(mine.gather(torch.arange(mine.numel())), theirs.long())
    for shard in (0, text_shards - 1):
        a = sampler(as_tokens.train, shard, seed=7, num_shards=text_shards)
        b = sampler(as_bytes.train, shard, seed=7, num_shards=text_shards)
        assert a.shard_range == b.shard_range
        for _ in range(3):
            (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
            assert xa.dtype == ya.dtype == torch.long
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    mine_eval = eval_batches(as_tokens.heldout, context=CONTEXT, batch_size=4, num_batches=3)
    their_eval = eval_batches(as_bytes.heldout, context=CONTEXT, batch_size=4, num_batches=3)
    assert len(mine_eval) == len(their_eval)
    for (xa, ya), (xb, yb) in zip(mine_eval, their_eval):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_train_and_heldout_tile_the_file_with_every_kth_block_held_out(tmp_path: Path) -> None:
    n, every = 20_003, 4  # a partial last block
    cfg, _ = positions_corpus(tmp_path, n, heldout_every=every)
    corpus = load_corpus(cfg, CONTEXT)
    train, heldout = all_positions(corpus.train), all_positions(corpus.heldout)  # type: ignore[arg-type]
    assert np.array_equal(np.sort(np.concatenate([train, heldout])), np.arange(n))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(heldout) > 0)  # file order
    block = max(CONTEXT + 1, min(cfg.block_bytes, n // (every * 4)))  # the bytes rule's shrink
    assert np.all(heldout // block % every == every - 1)
    assert np.all(train // block % every != every - 1)
    # gather reads the file: the value at each position is the position itself
    assert torch.equal(corpus.heldout.gather(torch.arange(corpus.heldout.numel())), torch.from_numpy(heldout))  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_sampler_is_deterministic_skips_and_resumes(tmp_path: Path, dtype: str) -> None:
    cfg, _ = positions_corpus(tmp_path, 30_000, dtype)
    corpus = load_corpus(cfg, CONTEXT, num_shards=3)
    a, b = sampler(corpus.train, 1, seed=0), sampler(corpus.train, 1, seed=0)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xa.shape == ya.shape == (8, CONTEXT) and xa.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(sampler(corpus.train, 1, seed=0).next_batch()[0], sampler(corpus.train, 1, seed=1).next_batch()[0])
    assert not torch.equal(sampler(corpus.train, 0, seed=0).next_batch()[0], sampler(corpus.train, 2, seed=0).next_batch()[0])

    stepped, skipped = sampler(corpus.train, 2, seed=4), sampler(corpus.train, 2, seed=4)
    for _ in range(5):
        stepped.next_batch()
    skipped.skip(5)
    assert torch.equal(stepped.next_batch()[0], skipped.next_batch()[0])

    original = sampler(corpus.train, 2, seed=5)
    original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(3)]
    resumed = sampler(corpus.train, 2, seed=99)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with pytest.raises(ValueError, match="shard"):
        sampler(corpus.train, 1, seed=5).load_state_dict(state)


def test_shards_touch_disjoint_file_positions_and_never_heldout(tmp_path: Path) -> None:
    # Small blocks, so many windows cross a held-out block and must skip it.
    cfg, _ = positions_corpus(tmp_path, 12_000, heldout_every=3, block_bytes=40)
    num_shards = 3
    corpus = load_corpus(cfg, CONTEXT, num_shards)
    train: TokenView = corpus.train  # type: ignore[assignment]
    heldout = set(all_positions(corpus.heldout).tolist())  # type: ignore[arg-type]
    touched: list[set[int]] = []
    crossed = 0
    for shard in range(num_shards):
        s = sampler(train, shard, seed=1, num_shards=num_shards)
        start, end = s.shard_range
        allowed = set(train.file_positions(np.arange(start, end)).tolist())
        seen: set[int] = set()
        for _ in range(60):
            x, y = s.next_batch()
            assert torch.equal(y[:, :-1], x[:, 1:])
            windows = torch.cat([x, y[:, -1:]], dim=1).numpy()
            steps = np.diff(windows, axis=1)
            assert np.all(steps >= 1)  # file order, contiguous in the train split
            crossed += int(np.any(steps > 1, axis=1).sum())
            seen.update(windows.ravel().tolist())
        assert seen <= allowed
        assert not seen & heldout
        touched.append(seen)
    assert crossed > 0, "some windows should cross a held-out block"
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not touched[i] & touched[j]


def test_eval_batches_are_fixed_heldout_windows(tmp_path: Path) -> None:
    cfg, _ = positions_corpus(tmp_path, 40_000, heldout_every=5)
    corpus = load_corpus(cfg, CONTEXT)
    first = eval_batches(corpus.heldout, context=CONTEXT, batch_size=8, num_batches=4)
    second = eval_batches(corpus.heldout, context=CONTEXT, batch_size=8, num_batches=4)
    assert len(first) == 4
    heldout = set(all_positions(corpus.heldout).tolist())  # type: ignore[arg-type]
    rows: list[int] = []
    for (xa, ya), (xb, yb) in zip(first, second):
        assert xa.shape == ya.shape == (8, CONTEXT) and xa.dtype == ya.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(ya[:, :-1], xa[:, 1:])
        assert set(xa.ravel().tolist()) | set(ya.ravel().tolist()) <= heldout
        rows.extend(xa[:, 0].tolist())
    assert len(set(rows)) == 32
    # Spread from the start of the held-out split to its end.
    assert min(rows) == min(heldout)
    assert max(rows) == int(corpus.heldout.gather(torch.tensor([corpus.heldout.numel() - CONTEXT - 1]))[0])  # type: ignore[union-attr]


def test_file_is_memory_mapped_not_copied(tmp_path: Path) -> None:
    n = 1 << 23  # 32 MiB of uint32
    cfg, path = positions_corpus(tmp_path, n)
    tracemalloc.start()
    try:
        corpus = load_corpus(cfg, context=64, num_shards=2)
        s = ShardSampler(corpus.train, shard=1, num_shards=2, batch_size=16, context=64, seed=0)
        for _ in range(4):
            s.next_batch()
        eval_batches(corpus.heldout, context=64, batch_size=16, num_batches=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size // 8, f"peak {peak} bytes while reading a {path.stat().st_size} byte file"
    for view in (corpus.train, corpus.heldout):
        assert isinstance(view, TokenView)
        assert isinstance(view.tokens, np.memmap) and not view.tokens.flags.writeable
        assert not any(isinstance(v, torch.Tensor) for v in vars(view).values())
    assert corpus.train.tokens is corpus.heldout.tokens  # type: ignore[union-attr]
    assert str(path) in corpus.source and corpus.files == 1


# --- errors: each names the field and, where there is one, the file -------------------------------


def test_tokens_without_path_is_an_error() -> None:
    with pytest.raises(DataError, match="data.path is required for data.format=tokens"):
        DataConfig(format="tokens", dtype="uint16", vocab_size=512)


@pytest.mark.parametrize("dtype", [None, "int8", "uint8", "float32"])
def test_unknown_dtype_names_field_and_file(tmp_path: Path, dtype: str | None) -> None:
    path = str(tmp_path / "t.bin")
    with pytest.raises(DataError) as info:
        DataConfig(path=path, format="tokens", dtype=dtype, vocab_size=512)
    assert f"data.dtype={dtype!r}" in str(info.value) and path in str(info.value)


@pytest.mark.parametrize("vocab_size", [None, 0, True, "512"])
def test_missing_vocab_size_names_field_and_file(tmp_path: Path, vocab_size: object) -> None:
    path = str(tmp_path / "t.bin")
    with pytest.raises(DataError) as info:
        DataConfig(path=path, format="tokens", dtype="uint16", vocab_size=vocab_size)  # type: ignore[arg-type]
    assert "data.vocab_size" in str(info.value) and path in str(info.value)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"format": "words"}, "data.format='words'"),
        ({"dtype": "uint16"}, "data.dtype='uint16'"),
        ({"vocab_size": 512}, "data.vocab_size=512"),
    ],
)
def test_bad_format_or_tokens_keys_with_bytes(values: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        DataConfig(**values)  # type: ignore[arg-type]


def tokens_cfg(path: Path, dtype: str = "uint16", vocab_size: int = 512, **cfg: object) -> DataConfig:
    return DataConfig(path=str(path), format="tokens", dtype=dtype, vocab_size=vocab_size, **cfg)  # type: ignore[arg-type]


def test_missing_file_or_directory_names_path(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.bin", tmp_path):
        with pytest.raises(DataError) as info:
            load_corpus(tokens_cfg(path), CONTEXT)
        assert f"data.path={path}" in str(info.value)


def test_size_not_a_multiple_of_the_dtype_names_file_and_dtype(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00" * 5000 + b"\x01")
    with pytest.raises(DataError) as info:
        load_corpus(tokens_cfg(path), CONTEXT)
    message = str(info.value)
    assert str(path) in message and "data.dtype=uint16" in message and "10001 bytes" in message
    path.write_bytes(b"\x01\x00" * 5001)  # a multiple of 2, not of 4
    with pytest.raises(DataError, match="not a multiple of 4"):
        load_corpus(tokens_cfg(path, dtype="uint32"), CONTEXT)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_at_or_above_vocab_names_first_offset_and_value(tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_module, "_SCAN_TOKENS", 1000)  # several chunks, the bad ids in a late one
    ids = np.arange(20_000) % 512
    ids[7_345], ids[9_000] = 600, 512
    path = write_tokens(tmp_path / f"bad.{dtype}.bin", ids, dtype)
    with pytest.raises(DataError) as info:
        load_corpus(tokens_cfg(path, dtype=dtype), CONTEXT)
    message = str(info.value)
    assert str(path) in message and "data.vocab_size=512" in message
    assert "token 600 at offset 7345" in message
    ids[7_345] = 511
    write_tokens(path, ids, dtype)
    with pytest.raises(DataError, match="token 512 at offset 9000"):
        load_corpus(tokens_cfg(path, dtype=dtype), CONTEXT)
    ids[9_000] = 0
    write_tokens(path, ids, dtype)
    assert load_corpus(tokens_cfg(path, dtype=dtype), CONTEXT).vocab_size == 512


def test_too_small_says_found_and_needed(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "small.bin", np.arange(100), "uint16")
    with pytest.raises(DataError) as info:
        load_corpus(tokens_cfg(path), CONTEXT)
    message = str(info.value)
    assert str(path) in message and "100 tokens" in message and str(20 * (CONTEXT + 1)) in message
    write_tokens(path, [], "uint16")
    with pytest.raises(DataError, match="found 0 tokens"):
        load_corpus(tokens_cfg(path), CONTEXT)


def test_minimum_size_is_exact_as_for_bytes(tmp_path: Path) -> None:
    window = CONTEXT + 1
    path = tmp_path / "probe.bin"
    for num_shards in (1, 3, 30):
        cfg = tokens_cfg(path, heldout_every=4)
        write_tokens(path, [1] * 10, "uint16")
        with pytest.raises(DataError) as info:
            load_corpus(cfg, CONTEXT, num_shards)
        needed = int(str(info.value).split("need at least ")[1].split()[0])
        write_tokens(path, [1] * (needed - 1), "uint16")
        with pytest.raises(DataError):
            load_corpus(cfg, CONTEXT, num_shards)
        write_tokens(path, [1] * needed, "uint16")
        corpus = load_corpus(cfg, CONTEXT, num_shards)
        assert corpus.heldout.numel() >= window
        for shard in (0, num_shards - 1):
            sampler(corpus.train, shard, seed=0, num_shards=num_shards).next_batch()


def test_sampler_rejects_bad_shard_and_too_small_shards(tmp_path: Path) -> None:
    cfg, _ = positions_corpus(tmp_path, 4000)
    corpus: Corpus = load_corpus(cfg, CONTEXT)
    with pytest.raises(ValueError, match="shard=3"):
        sampler(corpus.train, 3, seed=0)
    with pytest.raises(ValueError, match="tokens"):
        sampler(corpus.train, 0, seed=0, num_shards=1000)


def test_hydra_config_with_tokens_becomes_a_run_config(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_module

    from diloco.app.config import ConfigError
    from diloco.cli.common import SECTIONS, run_config

    path = write_tokens(tmp_path / "tokens.bin", np.arange(200_000) % 512, "uint16")
    overrides = ["data.format=tokens", f"data.path='{path}'", "data.dtype=uint16", "data.vocab_size=512", "+model.vocab_size=512"]
    with initialize_config_module("diloco.conf", version_base=None):
        cfg = run_config(compose(config_name="sim", overrides=overrides), SECTIONS["sim"])
        plain = run_config(compose(config_name="sim"), SECTIONS["sim"])
        # A model whose embedding cannot hold every token id of the data is refused, naming both.
        with pytest.raises(ConfigError, match=r"model.vocab_size=256: .*smaller than the data's vocabulary, data.vocab_size=512"):
            run_config(compose(config_name="sim", overrides=overrides[:-1]), SECTIONS["sim"])
        with pytest.raises(ConfigError, match="data.path is required for data.format=tokens"):
            run_config(compose(config_name="sim", overrides=["data.format=tokens", "data.dtype=uint16", "data.vocab_size=512"]), SECTIONS["sim"])
    assert (cfg.data.format, cfg.data.path, cfg.data.dtype, cfg.data.vocab_size) == ("tokens", str(path), "uint16", 512)
    assert cfg.data.vocab == 512
    assert (plain.data.format, plain.data.dtype, plain.data.vocab_size, plain.data.vocab) == ("bytes", None, None, 256)
    corpus = load_corpus(cfg.data, cfg.model.context, num_shards=cfg.sites)
    x, y = ShardSampler(corpus.train, shard=cfg.sites - 1, num_shards=cfg.sites, batch_size=2, context=cfg.model.context, seed=cfg.seed).next_batch()
    assert x.shape == (2, cfg.model.context) and int(x.max()) < 512
