"""diloco.DiLoCo beyond the three lines, through a real gRPC coordinator on 127.0.0.1:0:
per-step token counts (add_tokens, record_loss(tokens=)) reach the coordinator's round
records; an optimizer step after the last round warns once or raises RunFinished; a dropped
round shows on the object; the sync settings reach OuterSync (and the plug-ins' SiteSettings);
bad arguments are refused by name."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers import FakeClock, coordinator, join, push, served_coordinator

from diloco.api import DiLoCo, RunFinished, RunFinishedWarning
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.data import DataConfig, ShardSampler, load_corpus
from diloco.model import build_model, lm_loss, model_config
from diloco.outer import RobustConfig, params_sha256
from diloco.plugins.common import SiteSettings
from diloco.transport import CoordinatorClient

pytestmark = pytest.mark.timeout(120)
MODEL = model_config("tiny", context=32, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64)
NOWHERE = "127.0.0.1:1"  # no coordinator: for checks that never connect


@contextmanager
def _served_tiny_model(cfg: CoordinatorConfig, clock: FakeClock | None = None) -> Iterator[tuple[Coordinator, str, list]]:
    """A coordinator holding the tiny model's θ_0, served on 127.0.0.1:<free port>; yields it,
    its address and the list its committed RoundRecords are appended to."""
    coord = coordinator(dict(build_model(MODEL, seed=0).named_parameters()), cfg, clock=clock)
    records: list = []
    coord.on_commit.append(records.append)
    with served_coordinator(coord) as address:
        yield coord, address, records


def _loop() -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardSampler]:
    model = build_model(MODEL, seed=0)
    corpus = load_corpus(DataConfig(batch_size=4), MODEL.context)
    sampler = ShardSampler(corpus.train, shard=0, num_shards=1, batch_size=4, context=MODEL.context, seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), sampler


def _forward_backward(model: torch.nn.Module, sampler: ShardSampler) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = sampler.next_batch()
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss, x


def test_per_step_tokens_reach_the_coordinator() -> None:
    """add_tokens (several calls per step: micro-batches), record_loss(tokens=) and the
    tokens_per_step fallback for a step with none added; a count added after the step counts
    toward the next one."""
    with _served_tiny_model(CoordinatorConfig(total_rounds=2)) as (coord, address, records):
        model, optimizer, sampler = _loop()
        added: list[int] = []  # what each step should weigh
        with warnings.catch_warnings():
            warnings.simplefilter("error", RunFinishedWarning)  # the loop stops in time: no warning
            with DiLoCo(model, optimizer, coordinator=address, site_id="eu-1", sync_every=3, tokens_per_step=5) as dl:
                for step in range(10):
                    loss, x = _forward_backward(model, sampler)
                    if step % 3 == 0:
                        dl.add_tokens(x.numel())  # two micro-batches' worth
                        dl.add_tokens(7)
                        dl.record_loss(loss)
                        added.append(x.numel() + 7)
                    elif step % 3 == 1:
                        dl.record_loss(loss, tokens=torch.tensor(11 + step))  # an integer tensor counts too
                        added.append(11 + step)
                    else:
                        added.append(5)  # nothing added: tokens_per_step
                    optimizer.step()
                    optimizer.zero_grad()
                    if dl.finished:
                        break
        assert step == 5 and dl.steps == 6 and dl.steps_after_last_round == 0
        assert coord.committed_rounds == 2 and [r.round for r in records] == [0, 1]
        assert [r.tokens for r in records] == [sum(added[0:3]), sum(added[3:6])]
        assert [r.inner_steps for r in records] == [3, 3]
        assert all(r.train_loss is not None and math.isfinite(r.train_loss) for r in records)
        assert coord.left_sites() == {"eu-1": coord.global_sha256()}
        # An explicit count wins over added ones; the added ones are then discarded.
        dl.add_tokens(100)
        assert dl.step_done(3) is False and dl._pending_tokens is None  # noqa: SLF001


def _run_past_the_end(address: str, steps: int, after_last_round: str) -> tuple[DiLoCo, torch.nn.Module, int]:
    """One round of 2 steps, then ``steps`` - 2 more optimizer steps (local only); returns
    the site, its model and the steps the loop completed."""
    model, optimizer, sampler = _loop()
    done = 0
    with DiLoCo(model, optimizer, coordinator=address, site_id="eu-1", sync_every=2, after_last_round=after_last_round) as dl:
        for _ in range(steps):
            _forward_backward(model, sampler)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
    return dl, model, done


def test_after_last_round_warn_warns_once_and_the_steps_stay_local() -> None:
    with _served_tiny_model(CoordinatorConfig(total_rounds=1)) as (coord, address, _):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dl, model, done = _run_past_the_end(address, 5, "warn")
    late = [w for w in caught if issubclass(w.category, RunFinishedWarning)]
    assert len(late) == 1, [str(w.message) for w in late]
    message = str(late[0].message)
    assert "last round" in message and "local only" in message and "dl.finished" in message
    assert late[0].filename == __file__  # points at the user's optimizer.step() line
    assert done == 5 and dl.steps == 5 and dl.steps_after_last_round == 3 and dl.finished
    assert coord.committed_rounds == 1 and coord.left_sites() == {"eu-1": coord.global_sha256()}
    assert params_sha256(dict(model.named_parameters())) != coord.global_sha256()  # the local steps moved it


def test_after_last_round_raise_raises_on_the_first_step_after_it_and_still_leaves() -> None:
    with _served_tiny_model(CoordinatorConfig(total_rounds=1)) as (coord, address, _):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RunFinishedWarning)
            with pytest.raises(RunFinished, match="last round") as info:
                _run_past_the_end(address, 5, "raise")
        assert isinstance(info.value, RuntimeError)
        # Raised by the third optimizer.step() (the first after round 0), which had stepped:
        # the with block left the run all the same.
        assert coord.committed_rounds == 1 and coord.left_sites() == {"eu-1": coord.global_sha256()}


def test_a_dropped_round_shows_on_the_object() -> None:
    """Round 0 closes at its fixed deadline with the other site's push only (a fake clock
    makes it deterministic): the DiLoCo site's push is refused, its work dropped; it goes on
    from θ and takes part in round 1."""
    clock = FakeClock()
    cfg = CoordinatorConfig(total_rounds=2, min_sites=1, quorum=QuorumConfig(lease_s=100, deadline="fixed", deadline_s=30))
    with _served_tiny_model(cfg, clock) as (coord, address, records):
        theta0 = dict(build_model(MODEL, seed=0).named_parameters())
        zeros = {n: torch.zeros_like(p) for n, p in theta0.items()}

        def other_pushes(round: int) -> None:
            assert push(other, "other", round, zeros).accepted

        model, optimizer, sampler = _loop()
        with CoordinatorClient(address, timeout_s=30) as other:
            join(other, theta0, "other")
            with DiLoCo(model, optimizer, coordinator=address, site_id="late", sync_every=2) as dl:
                other_pushes(0)
                clock.t += 31  # past round 0's deadline
                assert coord.tick() is not None and coord.committed_rounds == 1
                for step in range(4):
                    if step == 2:
                        assert dl.dropped_rounds == [0] and dl.round == 1
                        other_pushes(1)  # round 1 then waits for the DiLoCo site only
                    _forward_backward(model, sampler)
                    optimizer.step()
                    optimizer.zero_grad()
                assert dl.finished
            assert dl.dropped_rounds == dl.sync.stats.dropped_rounds == [0]
            assert dl.merged_rounds == [] and dl.rejoins == 0
        assert [sorted(r.participants) for r in records] == [["other"], ["late", "other"]]
        assert records[1].tokens == 10 + 2  # the dropped round's tokens counted nowhere


def test_a_clean_run_drops_nothing() -> None:
    with _served_tiny_model(CoordinatorConfig(total_rounds=1)) as (_, address, _records):
        dl, _, _ = _run_past_the_end(address, 2, "raise")
    assert dl.dropped_rounds == dl.merged_rounds == [] and dl.rejoins == 0 and dl.finished


@pytest.mark.parametrize("error_feedback", [True, False])
def test_sync_settings_reach_outer_sync(error_feedback: bool) -> None:
    with _served_tiny_model(CoordinatorConfig(total_rounds=1)) as (coord, address, _):
        model, optimizer, sampler = _loop()
        with DiLoCo(
            model, optimizer, coordinator=address, site_id="eu-1", sync_every=1, codec="int8",
            error_feedback=error_feedback, error_feedback_decay=0.5, round_timeout_s=42.0,
        ) as dl:  # fmt: skip
            sync = dl.sync
            s = sync.settings  # the coordinator owns none here: the site's own, with what it was given
            assert (s.codec.name, s.error_feedback, s.error_feedback_decay, sync.options.timeouts.round_timeout_s) == ("int8", error_feedback, 0.5, 42.0)
            assert set(sync.options.stated) == {"sync.every", "codec", "error_feedback", "error_feedback_decay"}
            _forward_backward(model, sampler)
            optimizer.step()
            assert dl.finished
        # A lossy codec with error feedback keeps what it dropped for the next push; without, nothing.
        assert (sync.residual is not None) == error_feedback
        assert coord.committed_rounds == 1

        # The plug-ins take the same keywords (SiteSettings) and hand them on.
        with _served_tiny_model(CoordinatorConfig(total_rounds=1)) as (_, address2, _records):
            settings = SiteSettings(address2, "hf-1", 2, "int8", error_feedback=error_feedback, error_feedback_decay=0.25, round_timeout_s=9.0)
            site = settings.join(build_model(MODEL, seed=0))
            try:
                sync = site.sync
                s = sync.settings
                assert (s.sync.every, s.codec.name, s.error_feedback, s.error_feedback_decay, sync.options.timeouts.round_timeout_s) == (
                    2,
                    "int8",
                    error_feedback,
                    0.25,
                    9.0,
                )
            finally:
                site.leave()


def _make(**kwargs: object) -> DiLoCo:
    model = build_model(MODEL, seed=0)
    args = dict(coordinator=NOWHERE, site_id="eu-1", sync_every=2) | kwargs
    return DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, value",
    [
        ("error_feedback", "yes"),
        ("error_feedback", 1),
        ("error_feedback_decay", 1.5),
        ("error_feedback_decay", -0.1),
        ("error_feedback_decay", "0.5"),
        ("error_feedback_decay", True),
        ("round_timeout_s", 0),
        ("round_timeout_s", -1.0),
        ("round_timeout_s", math.nan),
        ("round_timeout_s", None),
        ("after_last_round", "ignore"),
        ("after_last_round", None),
    ],
)
def test_bad_arguments_are_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name}="):
        _make(**{name: value})
    if name != "after_last_round":  # the plug-ins' settings check the same
        with pytest.raises(ValueError, match=f"^{name}="):
            SiteSettings(NOWHERE, "hf-1", 2, **{name: value})


def test_good_edge_values_are_accepted() -> None:
    for kwargs in ({"error_feedback_decay": 0}, {"error_feedback_decay": 1}, {"round_timeout_s": math.inf}, {"after_last_round": "raise"}):
        _make(**kwargs).close()


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3", None, torch.tensor(2.0), torch.tensor([1, 2])])
def test_bad_token_counts_are_refused_by_name(bad: object) -> None:
    dl = _make()
    try:
        if bad is not None:
            with pytest.raises(ValueError, match=r"^n="):
                dl.add_tokens(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^tokens="):
            dl.record_loss(1.0, tokens=bad if bad is not None else -3)  # type: ignore[arg-type]
        assert dl._losses == [] and dl._pending_tokens is None  # noqa: SLF001 - nothing half-recorded
        with pytest.raises(ValueError, match=r"^tokens="):
            dl.after_step(bad if bad is not None else -3)  # type: ignore[arg-type]
        assert dl.steps == 0
    finally:
        dl.close()


def test_a_refused_push_still_applies_the_round_but_keeps_the_residual() -> None:
    """robust.norm_ratio refuses the DiLoCo site's push (its Δ is far above the other site's):
    the round goes on without it, the site applies the round's update as usual, and its int8
    residual does not move on, since the Δ it came from did not count."""
    cfg = CoordinatorConfig(total_rounds=1, min_sites=2, robust=RobustConfig(norm_ratio=2, min_history=1))
    with _served_tiny_model(cfg) as (coord, address, records):
        theta0 = dict(build_model(MODEL, seed=0).named_parameters())
        tiny = {n: torch.full_like(p, 1e-9) for n, p in theta0.items()}
        model, optimizer, sampler = _loop()
        with CoordinatorClient(address, timeout_s=30) as other:
            join(other, theta0, "other")
            assert push(other, "other", 0, tiny).accepted
            with DiLoCo(model, optimizer, coordinator=address, site_id="big", sync_every=2, codec="int8") as dl:
                for _ in range(2):
                    _forward_backward(model, sampler)
                    optimizer.step()
                    optimizer.zero_grad()
                assert dl.finished and dl.dropped_rounds == []
                assert dl.sync.residual is None  # the refused Δ's encoding error was not carried
                assert params_sha256({n: p.detach() for n, p in model.named_parameters()}) == coord.global_sha256()
        assert [r["site"] for r in records[0].refused] == ["big"] and records[0].tokens == 10
