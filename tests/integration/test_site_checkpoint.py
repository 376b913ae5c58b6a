"""A site's own checkpoint: what comes back, and when only part of it may."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from diloco.data import DataConfig, ShardSampler, load_corpus
from diloco.model import build_model, model_config
from diloco.site.checkpoint import SiteCheckpointer
from diloco.site.inner import InnerConfig, InnerTrainer

pytestmark = pytest.mark.timeout(120)


def _site(seed: int = 0) -> tuple[InnerTrainer, ShardSampler]:
    mcfg = model_config("tiny")
    corpus = load_corpus(DataConfig(), mcfg.context, num_shards=2)
    sampler = ShardSampler(corpus.train, shard=1, num_shards=2, batch_size=2, context=mcfg.context, seed=seed)
    return InnerTrainer(build_model(mcfg, seed), InnerConfig(), total_steps=100), sampler


def _train(trainer: InnerTrainer, sampler: ShardSampler, steps: int) -> list[float]:
    return [trainer.step(*sampler.next_batch()) for _ in range(steps)]


def _restore(directory: Path, trainer: InnerTrainer, sampler: ShardSampler, round: int, run_id: str = "run-a"):
    got: dict = {}
    checkpointer = SiteCheckpointer(directory, run_id, trainer, sampler, log=lambda m: got.setdefault("log", []).append(m))
    restored = checkpointer.restore(round=round, global_sha256="h3", set_residual=lambda r: got.setdefault("residual", r))
    return restored, got


def _save(directory: Path, trainer: InnerTrainer, sampler: ShardSampler, round: int, residual, tokens: int) -> Path:
    checkpointer = SiteCheckpointer(directory, "run-a", trainer, sampler)
    written = checkpointer.save(round=round, global_sha256=f"h{round}", residual=residual, tokens=tokens)
    checkpointer.close()
    return written.result()


def test_exact_resume_continues_as_if_never_stopped(tmp_path: Path) -> None:
    trainer, sampler = _site()
    _train(trainer, sampler, 3)
    residual = {"w": torch.randn(4)}
    _save(tmp_path, trainer, sampler, 3, residual, 77)
    # The reference goes on; the restarted one gets a fresh model with the same θ (what the
    # site pulls from the coordinator) and everything else from the checkpoint.
    theta = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    expected = _train(trainer, sampler, 3)
    again, sampler2 = _site()
    with torch.no_grad():
        for n, p in again.model.named_parameters():
            p.copy_(theta[n])
    restored, got = _restore(tmp_path, again, sampler2, round=3)
    assert restored is not None and restored.exact and restored.hash_matches and restored.tokens == 77
    assert torch.equal(got["residual"]["w"], residual["w"]) and again.steps_done == 3
    assert _train(again, sampler2, 3) == expected  # same losses: optimizer moments and data came back


def test_training_on_while_the_checkpoint_is_written_does_not_reach_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer thread is held until the site has trained 3 more steps (AdamW changes its
    # moments in place): the file must hold the state as it was at save().
    import diloco.site.checkpoint as site_checkpoint

    release = threading.Event()
    write = site_checkpoint.save_checkpoint

    def held(*args, **kwargs):
        assert release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(site_checkpoint, "save_checkpoint", held)
    trainer, sampler = _site()
    _train(trainer, sampler, 3)
    theta = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    checkpointer = SiteCheckpointer(tmp_path, "run-a", trainer, sampler)
    written = checkpointer.save(round=3, global_sha256="h3", residual=None, tokens=5)
    expected = _train(trainer, sampler, 3)  # while the write waits
    assert not written.done()
    release.set()
    checkpointer.close()
    assert written.result().is_file()
    again, sampler2 = _site()
    with torch.no_grad():
        for n, p in again.model.named_parameters():
            p.copy_(theta[n])
    restored, _ = _restore(tmp_path, again, sampler2, round=3)
    assert restored is not None and restored.exact
    assert _train(again, sampler2, 3) == expected


def test_a_failed_background_write_is_raised_by_the_next_save_and_by_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco.site.checkpoint as site_checkpoint

    def broken(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(site_checkpoint, "save_checkpoint", broken)
    trainer, sampler = _site()
    checkpointer = SiteCheckpointer(tmp_path, "run-a", trainer, sampler)
    checkpointer.save(round=1, global_sha256="h1", residual=None, tokens=1)
    with pytest.raises(OSError, match="No space left"):  # round 1's write failed: round 2 is not written
        checkpointer.save(round=2, global_sha256="h2", residual=None, tokens=2)
    checkpointer.save(round=3, global_sha256="h3", residual=None, tokens=3)
    with pytest.raises(OSError, match="No space left"):
        checkpointer.close()
    assert not list(tmp_path.iterdir())


def test_a_later_round_restores_only_the_optimizer(tmp_path: Path) -> None:
    trainer, sampler = _site()
    _train(trainer, sampler, 2)
    _save(tmp_path, trainer, sampler, 2, {"w": torch.ones(2)}, 5)
    again, sampler2 = _site()
    restored, got = _restore(tmp_path, again, sampler2, round=5)  # rounds 2..4 were committed since
    assert restored is not None and not restored.exact and not restored.hash_matches
    assert "residual" not in got and again.steps_done == 0  # the residual was partly sent since
    state = again.optimizer.state_dict()["state"]
    assert state and all(int(s["step"]) == 2 for s in state.values())


def test_another_runs_checkpoint_or_a_corrupt_one_is_not_loaded(tmp_path: Path) -> None:
    trainer, sampler = _site()
    _train(trainer, sampler, 1)
    path = _save(tmp_path, trainer, sampler, 1, None, 1)
    fresh, sampler2 = _site()
    restored, got = _restore(tmp_path, fresh, sampler2, round=1, run_id="run-b")
    assert restored is None and "is of run run-a" in got["log"][0]
    path.write_bytes(path.read_bytes()[:-5])  # the only checkpoint is truncated: start fresh, say why
    restored, got = _restore(tmp_path, fresh, sampler2, round=1)
    assert restored is None and "no usable site checkpoint" in got["log"][0] and not fresh.optimizer.state_dict()["state"]
