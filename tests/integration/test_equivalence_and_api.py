"""Integration through a real gRPC coordinator on 127.0.0.1:0:
- one site, H=1, outer SGD lr=1 without momentum is plain training (to 1e-6);
- a plain hand-written loop becomes a site with three added lines (diloco.DiLoCo)."""

import threading
import warnings

import pytest
import torch

from diloco.api import RunFinishedWarning
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.data import DataConfig, ShardSampler, load_corpus
from diloco.model import build_model, lm_loss, model_config
from diloco.outer import OuterConfig, params_sha256
from diloco.site.inner import InnerConfig, InnerTrainer
from diloco.site.outer_sync import OuterSync
from diloco.transport import CoordinatorClient, serve

pytestmark = pytest.mark.timeout(120)
MODEL = model_config("tiny", context=32, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64)


def _sampler(seed: int = 0, shard: int = 0, num_shards: int = 1) -> ShardSampler:
    corpus = load_corpus(DataConfig(batch_size=4), MODEL.context, num_shards=num_shards)
    return ShardSampler(corpus.train, shard=shard, num_shards=num_shards, batch_size=4, context=MODEL.context, seed=seed)


def _serve(outer: OuterConfig, rounds: int, min_sites: int = 1) -> tuple[Coordinator, object, str]:
    coord = Coordinator(dict(build_model(MODEL, seed=0).named_parameters()), outer, CoordinatorConfig(total_rounds=rounds, min_sites=min_sites))
    server, port = serve(coord, "127.0.0.1", 0)
    return coord, server, f"127.0.0.1:{port}"


def test_one_site_h1_outer_sgd_lr1_equals_plain_training() -> None:
    steps = 12
    inner = InnerConfig(lr=3e-3, warmup_steps=3)
    plain = build_model(MODEL, seed=0)
    trainer = InnerTrainer(plain, inner, total_steps=steps)
    sampler = _sampler()
    for _ in range(steps):
        trainer.step(*sampler.next_batch())

    coord, server, address = _serve(OuterConfig(name="SGD", lr=1.0, momentum=0.0, nesterov=False), rounds=steps)
    try:
        site_model = build_model(MODEL, seed=0)
        site_trainer = InnerTrainer(site_model, inner, total_steps=steps)
        sampler = _sampler()
        with CoordinatorClient(address, timeout_s=30) as client:
            sync = OuterSync(site_model, client, "0")
            sync.join()
            for _ in range(steps):
                loss = site_trainer.step(*sampler.next_batch())
                sync.sync(tokens=4 * MODEL.context, train_loss=loss, inner_steps=1)
            assert sync.finished
            assert sync.global_sha256() == coord.global_sha256()
    finally:
        server.stop(grace=None).wait(5)
    final = coord.global_params()
    max_diff = max(float((final[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
    assert max_diff <= 1e-6, max_diff
    # ...and the outer loop really moved θ (the comparison is not between two untouched models).
    assert params_sha256(final) != params_sha256(dict(build_model(MODEL, seed=0).named_parameters()))


def _users_training_loop(site: int, address: str, steps: int, out: dict[str, object]) -> None:
    """A plain PyTorch loop as a user writes it; the three DiLoCo lines are marked."""
    from diloco import DiLoCo  # DiLoCo line 1

    model = build_model(MODEL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = _sampler(seed=0, shard=site, num_shards=2)
    with DiLoCo(model, optimizer, coordinator=address, site_id=str(site), sync_every=3) as dl:  # DiLoCo line 2
        for _ in range(steps):
            x, y = sampler.next_batch()
            loss = lm_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dl.record_loss(loss)  # DiLoCo line 3 (optional: reports the training loss)
    out[f"hash{site}"] = dl.sync.global_sha256()
    out[f"rounds{site}"] = dl.round
    out[f"model{site}"] = params_sha256(dict(model.named_parameters()))


def test_plain_loop_with_three_added_lines_trains_against_a_real_coordinator() -> None:
    coord, server, address = _serve(OuterConfig(), rounds=3, min_sites=2)
    out: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(site: int) -> None:
        try:
            # 10 steps: three rounds of 3, then one more local step after the last round.
            _users_training_loop(site, address, 10, out)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    try:
        # The step after the last round is local only: each site warns once (after_last_round="warn").
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for t in threads:
                t.start()
            for t in threads:
                t.join(100)
    finally:
        server.stop(grace=None).wait(5)
    assert not errors, errors
    late = sorted(str(w.message) for w in warned if issubclass(w.category, RunFinishedWarning))
    assert len(late) == 2 and "site '0'" in late[0] and "site '1'" in late[1], late
    assert coord.committed_rounds == 3
    assert out["rounds0"] == out["rounds1"] == 3
    assert out["hash0"] == out["hash1"] == coord.global_sha256()
    # The step after the last round trained locally: the model moved away from θ.
    assert out["model0"] != coord.global_sha256()
    assert set(coord.left_sites()) == {"0", "1"}
