"""The coordinator's parts on their own, without the façade or a lock: the round book's phases
(control plane), the sessions' admission and leases (control plane), the shard's sum and outer
step (data plane), the intake's staging and norm bound (data plane) and the gate's checks."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.codec import get_codec
from diloco.coordinator import CoordinatorConfig, CoordinatorError
from diloco.coordinator.commit import Closing
from diloco.coordinator.gate import Gate
from diloco.coordinator.intake import Intake
from diloco.coordinator.round_book import Phase, RoundBook
from diloco.coordinator.round_policy import QuorumConfig
from diloco.coordinator.sessions import Sessions
from diloco.coordinator.shard import Shard
from diloco.outer import OuterConfig, RobustConfig
from diloco.types import PushHeader, TensorSpec
from diloco.wire import encode_chunks

SGD = OuterConfig(name="SGD", lr=1.0, momentum=0.0, nesterov=False)


def _header(site: str, round: int = 0, tokens: int = 10) -> PushHeader:
    return PushHeader(site_id=site, round=round, tokens=tokens, train_loss=1.0, inner_steps=1)


# ---- the round book (control plane) --------------------------------------------------------


def test_the_round_book_goes_open_closing_serving_open() -> None:
    book = RoundBook(total_rounds=2, started=100.0)
    assert (book.open, book.phase, book.servable(0), book.servable(0, early=True)) == (0, Phase.OPEN, False, False)
    shard = Shard(SGD, CoordinatorConfig(total_rounds=2))
    shard.install({"w": torch.zeros(2)}, "test")
    book.reopen(0, 100.0, *shard.open(0))
    assert book.current.take(_header("a"), 101.0, None) == 10.0
    record, _ = shard.commit(book.current, Closing(frozenset({"a"}), 102.0, book.started, False), {})
    book.closing(record)
    assert book.phase == Phase.CLOSING and not book.servable(0, early=True)
    book.serving()
    assert book.phase == Phase.SERVING and book.servable(0, early=True) and not book.servable(0)
    book.published(0, {"round": 0})
    assert (book.open, book.phase, book.servable(0), book.participants) == (1, Phase.OPEN, True, {0: ["a"]})
    assert book.counted_before("a", 0) and not book.counted_before("b", 0)


def test_late_pushes_are_noted_once_per_open_round() -> None:
    book = RoundBook(total_rounds=3, started=0.0)
    book.published(0, {})
    book.note_late("b", 0)
    book.note_late("b", 0)
    assert book.late_pushes(1) == [{"site": "b", "round": 0}] and book.late_pushes(0) == []


def test_the_round_book_survives_a_checkpoint_and_elapsed_time_goes_on() -> None:
    book = RoundBook(total_rounds=3, started=0.0)
    book.participants, book.records = {0: ["a"]}, {0: {"elapsed_s": 7.0}}
    book.merged_done.add(("b", 0))
    again = RoundBook(total_rounds=3, started=50.0)
    again.restore(book.checkpoint(committed=1), now=60.0)
    assert (again.open, again.participants, again.merged_done, again.started) == (1, {0: ["a"]}, {("b", 0)}, 53.0)


# ---- the sessions (control plane) ----------------------------------------------------------


def test_sessions_admit_only_the_runs_sites_and_renew_only_members(fake_clock) -> None:
    s = Sessions(CoordinatorConfig(total_rounds=1, sites=("a", "b")), fake_clock)
    with pytest.raises(CoordinatorError, match="'c' is not one of this run's sites") as e:
        s.check_admissible("c")
    assert e.value.kind == "permission_denied"
    s.check_admissible("a")
    s.admit("a")
    s.renew("a")
    with pytest.raises(CoordinatorError) as e:
        s.renew("b")
    assert e.value.kind == "failed_precondition"
    s.leave("a", "0" * 64)
    assert s.left == {"a": "0" * 64} and s.members.active == frozenset()


def test_sessions_cap_the_number_of_ids_without_a_list(fake_clock) -> None:
    s = Sessions(CoordinatorConfig(total_rounds=1, max_sites=1), fake_clock)
    s.admit("a")
    s.check_admissible("a")  # a known id comes back
    with pytest.raises(CoordinatorError, match="this run has 1 site"):
        s.check_admissible("b")


def test_a_restored_session_opens_the_start_barrier_and_keeps_its_members(fake_clock) -> None:
    cfg = CoordinatorConfig(total_rounds=1, quorum=QuorumConfig(start_wait_s=60.0), max_sites=2)
    s = Sessions(cfg, fake_clock)
    s.admit("a")
    again = Sessions(cfg, fake_clock)
    assert not again.barrier.open
    again.restore(s.checkpoint())
    assert again.barrier.open and again.members.active == {"a"}


# ---- the shard (data plane) ----------------------------------------------------------------


def test_the_shard_sums_weighted_pushes_and_steps_theta_without_knowing_sites() -> None:
    shard = Shard(SGD, CoordinatorConfig(total_rounds=1, aggregate="mean"))
    shard.install({"w": torch.zeros(3)}, "test")
    book = RoundBook(total_rounds=1, started=0.0)
    book.reopen(0, 0.0, *shard.open(0))
    for site, value, tokens in (("a", 1.0, 10), ("b", 4.0, 30)):
        weight = book.current.take(_header(site, tokens=tokens), 1.0, None)
        shard.add({"w": torch.full((3,), value)}, weight)
    record, update = shard.commit(book.current, Closing(frozenset({"a", "b"}), 2.0, 0.0, False), {})
    # mean Δ = (1·10 + 4·30) / 40 = 3.25; SGD lr 1: θ = 0 − 3.25
    assert torch.equal(shard.outer.params["w"], torch.full((3,), -3.25))
    assert record.participants == ["a", "b"] and record.tokens == 40 and update


def test_the_shard_opens_each_round_with_its_fragment_and_refuses_another_fragments_tensor() -> None:
    shard = Shard(SGD, CoordinatorConfig(total_rounds=4, fragments=2))
    shard.install({"blocks.0.w": torch.zeros(2), "blocks.1.w": torch.zeros(2)}, "test")
    assert shard.open(1) == (("blocks.1.w",), 1)
    assert list(shard.round_specs(0)) == ["blocks.0.w"]
    with pytest.raises(CoordinatorError, match="of fragment 1; round 0 syncs fragment 0 of 2"):
        shard.check_fragment(0, "blocks.1.w")


def test_a_clipped_push_is_scaled_before_it_is_summed() -> None:
    shard = Shard(SGD, CoordinatorConfig(total_rounds=1))
    shard.install({"w": torch.zeros(2)}, "test")
    shard.open(0)
    shard.add({"w": torch.full((2,), 8.0)}, 1.0, scale=0.25)
    assert torch.equal(shard.acc.mean()["w"], torch.full((2,), 2.0))


# ---- the intake (data plane) ---------------------------------------------------------------


def test_the_intake_decodes_into_a_staging_buffer_and_judges_norms() -> None:
    intake = Intake(CoordinatorConfig(total_rounds=1, robust=RobustConfig(norm_ratio=3.0, min_history=1)))
    specs = {"w": TensorSpec("w", (4,), "float32")}
    chunks = ((c, None) for c in encode_chunks({"w": torch.full((4,), 2.0)}, codec=get_codec("fp32")))
    with intake.receive(_header("a"), chunks, specs, lambda _name: None) as got:
        assert torch.equal(got.delta["w"], torch.full((4,), 2.0)) and got.payload_bytes == 16 and got.size == 4.0
    assert intake.judge("a", 4.0).action == "take"
    assert intake.judge("b", 100.0).action == "reject" and intake.refusals == {"b": 1}


# ---- the gate ----------------------------------------------------------------------------


def test_the_gate_refuses_every_call_once_the_coordinator_failed(fake_clock) -> None:
    cv = threading.Condition()
    cfg = CoordinatorConfig(total_rounds=1)
    sessions, shard = Sessions(cfg, fake_clock), Shard(SGD, cfg)
    gate = Gate(cv, sessions, RoundBook(1, 0.0), shard)
    with pytest.raises(CoordinatorError, match="θ₀ is not set yet"):
        gate.ready()
    sessions.admit("a")
    with cv:
        gate.member("a")
        gate.fail("the checkpoint of round 0", OSError("disk full"))
    with pytest.raises(CoordinatorError, match=r"has failed \(the checkpoint of round 0 failed: OSError: disk full\)") as e:
        gate.member("a")
    assert e.value.kind == "unavailable"


def test_a_pull_of_some_tensors_encodes_them_alone_and_whole_pulls_share_the_rounds_encoding() -> None:
    from diloco.boxes import Box
    from diloco.coordinator.downlink import Downlink
    from diloco.wire import fingerprint

    theta = {"a": torch.arange(6.0), "b": torch.ones(3, 4), "c": torch.zeros(5)}
    downlink = Downlink(fingerprint(theta), keep_updates=2)
    asked: list[list[str] | None] = []

    def encode(names: list[str] | None) -> list:
        asked.append(None if names is None else list(names))
        some = theta if names is None else {n: theta[n] for n in names}
        return list(encode_chunks(some, codec=get_codec("fp32")))

    one = downlink.global_params(0, encode, {"c": Box.whole((5,))})  # the start barrier's smallest tensor
    assert {c.name for c in one} == {"c"} and asked == [["c"]]
    for want in (None, None, {n: Box.whole(tuple(t.shape)) for n, t in theta.items()}):  # a whole pull; a multi-rank site's every tensor
        downlink.global_params(0, encode, want)
    assert asked == [["c"], None]  # θ whole encoded once for the round, shared
    downlink.global_params(1, encode, None)
    assert asked == [["c"], None, None]  # and again for the next round
