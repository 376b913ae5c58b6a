"""The checkpoint file (diloco.checkpoint): streamed and hashed by segment, every kind of state
round-trips, format 1 is still read, a tampered tensor reference is refused even under a good
checksum, pruning keeps one spare to write over, and a failing write leaves no file."""

from __future__ import annotations

import collections
import hashlib
import time
import zlib
from pathlib import Path

import pytest
import torch
from helpers import generator as _g

from diloco import checkpoint as ck

pytestmark = pytest.mark.timeout(60)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def _rich_state() -> dict:
    g = _g()
    big = torch.randn(64, 33, generator=g)
    return {
        "outer": {"params": {f"p{i}": torch.randn(1000 * i + 3, generator=g) for i in range(12)}, "optimizer": {"state": {0: {"momentum_buffer": big * 2, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.7, "params": [0]}]}},
        "dtypes": [torch.randn(3000, generator=g).to(d) for d in (torch.float16, torch.bfloat16, torch.float64)] + [torch.arange(5000), torch.arange(5000) % 3 == 0, torch.zeros(0, 2048)],
        "view": big.t(), "small": torch.ones(3), "large": torch.randn(700_000, generator=g), "tuple": (1, "a", big[:40]), "od": collections.OrderedDict(b=1, a=torch.zeros(2048)),
        "meta": {"round": 3, "names": ["a", "b"], "pairs": [("s", 1)], 7: None},
    }  # fmt: skip


def test_a_checkpoint_round_trips_every_kind_of_state(tmp_path: Path) -> None:
    state = _rich_state()
    path = ck.save_checkpoint(tmp_path, 3, state)
    data = path.read_bytes()
    magic, version, length, digest = ck._HEADER.unpack_from(data)
    payload = data[ck._HEADER.size :]
    assert (magic, version, length) == (ck.MAGIC, 3, len(payload))
    segments = [zlib.crc32(payload[i : i + (1 << 20)]).to_bytes(4, "little") for i in range(0, len(payload), 1 << 20)]
    assert len(segments) > 1 and hashlib.sha256(b"".join(segments)).digest() == digest
    loaded = ck.read_checkpoint(path)
    assert _same(state, loaded)
    assert loaded["view"].is_contiguous()  # saved as its values
    w = loaded["outer"]["params"]["p3"]
    w += 1  # each loaded tensor owns its memory
    assert torch.equal(ck.read_checkpoint(path)["outer"]["params"]["p3"], state["outer"]["params"]["p3"])


def test_a_format_2_checkpoint_is_still_read(tmp_path: Path) -> None:
    """Format 2 (SHA-256s of the segments) as the build before format 3 wrote it; and a flipped
    byte in it is still found."""
    state = _rich_state()
    path = ck.save_checkpoint(tmp_path, 3, state)
    payload = path.read_bytes()[ck._HEADER.size :]
    path.write_bytes(ck._HEADER.pack(ck.MAGIC, 2, len(payload), ck._tree_digest(memoryview(payload), 2)) + payload)
    assert _same(state, ck.read_checkpoint(path))
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 1
    path.write_bytes(ck._HEADER.pack(ck.MAGIC, 2, len(payload), ck._tree_digest(memoryview(payload), 2)) + bytes(bad))
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.read_checkpoint(path)


def test_a_format_1_checkpoint_is_still_read(tmp_path: Path) -> None:
    import io

    state = _rich_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(ck._HEADER.pack(ck.MAGIC, 1, len(payload), hashlib.sha256(payload).digest()) + payload)
    assert _same(state, ck.read_checkpoint(path))


def test_a_tampered_tensor_reference_is_refused_even_with_a_good_checksum(tmp_path: Path) -> None:
    import io

    path = ck.save_checkpoint(tmp_path, 1, {"w": torch.zeros(4096)})
    payload = path.read_bytes()[ck._HEADER.size :]
    for ref in (
        [0, 1 << 40, "float32", [1 << 38]],
        [0, 16384, "float32", [4097]],
        [0, 16384, "complex64", [2048]],
        [-64, 16384, "float32", [4096]],
        "x",
        [0, 16384, "float32", [-4096]],
    ):
        buf = io.BytesIO()
        torch.save({"w": {ck._RAW_KEY: ref}}, buf)
        skeleton = buf.getvalue()
        forged = payload[:16384] + skeleton + ck._LENGTH.pack(len(skeleton))
        path.write_bytes(ck._HEADER.pack(ck.MAGIC, 3, len(forged), ck._tree_digest(memoryview(forged))) + forged)
        with pytest.raises(ck.CheckpointError, match="payload does not load"):
            ck.read_checkpoint(path)
    with pytest.raises(ValueError, match="may not hold the key"):
        ck.save_checkpoint(tmp_path, 2, {"x": {ck._RAW_KEY: 1}})


def test_pruning_keeps_one_spare_to_write_over_and_deletes_the_rest(tmp_path: Path) -> None:
    (tmp_path / ".ckpt-00000000.pt.old").write_bytes(b"left by a crash")
    sizes = [100000, 10, 50000, 70000, 5, 200000]  # the spare written over is longer, or shorter
    for r, n in enumerate(sizes, start=1):
        ck.save_checkpoint(tmp_path, r, {"r": r, "w": torch.full((n,), float(r))}, keep=2)
        assert [p.name for p in ck.list_checkpoints(tmp_path)] == [f"ckpt-{k:08d}.pt" for k in range(max(1, r - 1), r + 1)]
        loaded = ck.load_latest(tmp_path)
        assert loaded is not None and loaded.round == r and torch.equal(loaded.state["w"], torch.full((n,), float(r)))
    ck.save_checkpoint(tmp_path, 7, {"r": 7}, keep=1)  # two pruned at once: one spare, one deleted
    deadline = time.monotonic() + 10
    while list(tmp_path.glob(".*.old")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt-spare", "ckpt-00000007.pt"]


def test_a_failing_write_leaves_no_file_and_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck.save_checkpoint(tmp_path, 1, {"r": 1})

    def full(*_args: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(tmp_path, 2, {"r": torch.zeros(100000)})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.pt"]
    ck.save_checkpoint(tmp_path, 2, {"r": 2})
    ck.save_checkpoint(tmp_path, 3, {"r": 3})  # a spare now: its write fails the same way
    monkeypatch.setattr(ck.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(tmp_path, 4, {"r": torch.zeros(100000)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.pt", "ckpt-00000003.pt"]
    assert ck.load_latest(tmp_path).round == 3  # type: ignore[union-attr]
