"""Property tests of checkpoint loading: a damaged (truncated, extended, bit-flipped) or
foreign file is refused with a CheckpointError naming it and the newest good checkpoint is
loaded instead, as diloco.checkpoint documents; a site's checkpoint of any content restores
whole, or is ignored (logged, nothing applied), or is refused naming the file."""

from __future__ import annotations

import hashlib
import io
import pickle
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from diloco import checkpoint as ck
from diloco.data import ShardSampler
from diloco.site.checkpoint import SiteCheckpointer
from diloco.site.inner import InnerConfig, InnerTrainer

# Few examples: every one writes files.
PROPERTY = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HEADER = struct.Struct("<4sIQ32s")  # diloco.checkpoint's file header: magic, version, length, sha256


def _state(r: int) -> dict[str, Any]:
    return {"round": r, "theta": {"w": torch.full((3, 2), float(r))}, "members": {"a": {"state": "active"}}}


def _file_around(payload: bytes) -> bytes:
    """``payload`` behind a valid header and checksum: what another program could write."""
    return HEADER.pack(ck.MAGIC, ck.VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _NotAllowed:  # weights_only loading refuses to build arbitrary classes
    pass


DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**7), st.integers(1, 255)), min_size=1, max_size=3)),
    st.tuples(st.just("truncate"), st.integers(0, 10**7)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("replace"), st.binary(max_size=200)),
    st.tuples(
        st.just("foreign"),  # a valid header and checksum around something that is not our state
        st.one_of(
            st.binary(max_size=200),
            st.sampled_from([_saved([1, 2]), _saved(torch.ones(2)), _saved(7), _saved(None)]),
            st.sampled_from([pickle.dumps(_NotAllowed(), protocol=2), pickle.dumps({"a": 1}, protocol=2)]),
        ),
    ),
)


def _damage(data: bytes, damage: tuple[str, Any]) -> bytes:
    kind, arg = damage
    if kind == "flip":
        b = bytearray(data)
        for pos, mask in arg:
            b[pos % len(b)] ^= mask
        return bytes(b)
    if kind == "truncate":
        return data[: arg % len(data)]
    if kind == "extend":
        return data + arg
    if kind == "replace":
        return arg
    return _file_around(arg)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch, reading random bytes
@settings(PROPERTY, max_examples=60)
@given(damage=DAMAGE)
@example(damage=("foreign", _saved([1, 2]))).via("bug: a checksummed list loaded as a checkpoint's state")
@example(damage=("foreign", b"c")).via("bug: torch's page-long message, echoing the file, passed on whole")
def test_a_damaged_or_foreign_newest_checkpoint_is_named_and_the_previous_one_loaded(tmp_path: Path, damage: tuple[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        ck.save_checkpoint(Path(d), 1, _state(1))
        newest = ck.save_checkpoint(Path(d), 2, _state(2))
        good = newest.read_bytes()
        bad = _damage(good, damage)
        newest.write_bytes(bad)
        if bad == good:
            assert ck.load_latest(Path(d)).round == 2  # type: ignore[union-attr]
            return
        with pytest.raises(ck.CheckpointError, match=newest.name) as e:
            ck.read_checkpoint(newest)
        assert len(str(e.value)) <= 300 + len(str(newest))
        loaded = ck.load_latest(Path(d))
        assert loaded is not None and loaded.round == 1 and torch.equal(loaded.state["theta"]["w"], torch.full((3, 2), 1.0))
        assert len(loaded.problems) == 1 and newest.name in loaded.problems[0]


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@settings(PROPERTY, max_examples=15)
@given(damages=st.lists(DAMAGE, min_size=2, max_size=2), stray=st.binary(max_size=100))
def test_with_no_good_checkpoint_every_bad_one_is_named(tmp_path: Path, damages: list[tuple[str, Any]], stray: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        paths = [ck.save_checkpoint(Path(d), r, _state(r)) for r in (1, 2)]
        for p, damage in zip(paths, damages):
            good = p.read_bytes()
            p.write_bytes(_damage(good, damage) if _damage(good, damage) != good else good[:-1])
        (Path(d) / ".ckpt-00000003.pt.x1.tmp").write_bytes(stray)  # a write torn by a crash: never read
        (Path(d) / "ckpt-00000004.pt").mkdir()  # not even a file
        with pytest.raises(ck.CheckpointError) as e:
            ck.load_latest(Path(d))
        assert all(name in str(e.value) for name in ("ckpt-00000001.pt", "ckpt-00000002.pt", "ckpt-00000004.pt"))
        assert ".tmp" not in str(e.value)


# ---- a site's own checkpoint ----------------------------------------------------------------


def _site() -> tuple[InnerTrainer, ShardSampler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    trainer = InnerTrainer(model, InnerConfig(), total_steps=10)
    model(torch.randn(4, 3)).square().sum().backward()
    trainer.optimizer.step()  # moments to save
    trainer.steps_done = 1
    return trainer, ShardSampler(torch.arange(200, dtype=torch.uint8), shard=0, num_shards=1, batch_size=1, context=4, seed=0)


GOOD_TRAINER, GOOD_SAMPLER = _site()
GOOD: dict[str, Any] = {
    "run_id": "run-a",
    "round": 3,
    "global_sha256": "h3",
    "optimizer": GOOD_TRAINER.optimizer.state_dict(),
    "steps_done": 1,
    "sampler": GOOD_SAMPLER.state_dict(),
    "residual": {"w": torch.ones(2)},
    "tokens": 77,
}
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=5), st.just({}), st.just([1]), st.just(torch.zeros(2)))
OTHER_SHARD = {**GOOD_SAMPLER.state_dict(), "shard": 1, "num_shards": 2}


@st.composite
def site_states(draw: st.DrawFn) -> dict[str, Any]:
    """What a site's checkpoint file may hold: our state with fields dropped or replaced by
    anything (optimizer and sampler states of another shape included)."""
    state = dict(GOOD)
    for key in list(state):
        action = draw(st.sampled_from(["keep", "keep", "drop", "junk"]))
        if action == "drop":
            del state[key]
        elif action == "junk":
            state[key] = draw(JUNK)
    if draw(st.booleans()):
        state["optimizer"] = draw(st.sampled_from([{"state": {}, "param_groups": []}, {"state": [], "param_groups": [{}]}, {"param_groups": 1}]))
    if draw(st.booleans()):
        state["sampler"] = draw(st.sampled_from([OTHER_SHARD, {**GOOD_SAMPLER.state_dict(), "generator": torch.zeros(3)}, {"shard": 0}]))
    return state


def _optimizer_state(trainer: InnerTrainer) -> list[torch.Tensor]:
    return [t.clone() for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()]


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=60)
@given(state=site_states(), round=st.sampled_from([3, 5]))
@example(state={k: v for k, v in GOOD.items() if k != "tokens"}, round=3).via("bug: KeyError for a checkpoint without 'tokens'")
@example(state={**GOOD, "steps_done": "7"}, round=3).via("bug: ValueError from int() of a string")
def test_a_site_checkpoint_of_any_content_restores_or_is_ignored_or_refused(tmp_path: Path, state: dict[str, Any], round: int) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        ck.save_checkpoint(Path(d), 3, state)
        trainer, sampler = _site()
        trainer.optimizer.state.clear()  # a fresh start: no moments
        logs: list[str] = []
        residuals: list[object] = []
        checkpointer = SiteCheckpointer(Path(d), "run-a", trainer, sampler, log=logs.append)
        try:
            restored = checkpointer.restore(round=round, global_sha256="h3", set_residual=residuals.append)
        except ck.CheckpointError as e:
            assert "ckpt-00000003.pt" in str(e) and "sampler" in str(e)
            event("refused")
            return
        event("ignored" if restored is None else "restored")
        if restored is None:
            assert len(logs) == 1 and ("ckpt-00000003.pt" in logs[0])
            assert not trainer.optimizer.state and residuals == [] and trainer.steps_done == 1  # nothing applied
            return
        assert restored.round == 3 and restored.tokens == state["tokens"] and restored.exact == (round == 3)
        assert [float(t.sum()) for t in _optimizer_state(trainer)] == [float(t.sum()) for t in _optimizer_state(GOOD_TRAINER)]
        assert len(residuals) == (round == 3)
        for got in residuals:  # the residual as saved: None, or the same tensors
            want = state["residual"]
            assert got is None if want is None else sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
