"""A site that has no pseudo-gradient for a round says so (PushHeader.withheld): the round stops
waiting for it, counts nothing of it and goes on; a round where every site withheld leaves θ
where it was. What the DiLoCo paper's dropped workers are, made a protocol message."""

from __future__ import annotations

import pytest
import torch
from helpers import coordinator, filled, push

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.errors import CoordinatorError
from diloco.outer import OuterConfig

pytestmark = pytest.mark.timeout(60)
THETA = {"w": torch.zeros(8)}
NESTEROV = OuterConfig(name="SGD", lr=1.0, momentum=0.9, nesterov=True)


def _coord(sites: int = 4, rounds: int = 3, min_sites: int | None = None, withheld: str = "skip", aggregate: str = "mean") -> tuple[Coordinator, list]:
    cfg = CoordinatorConfig(total_rounds=rounds, min_sites=min_sites or sites, quorum=QuorumConfig(withheld=withheld), aggregate=aggregate)
    c = coordinator(THETA, cfg, outer=NESTEROV, sites=tuple(str(s) for s in range(sites)))
    records: list = []
    c.on_commit.append(records.append)
    return c, records


def _withhold(c: Coordinator, site: int, round: int, why: str = "lost on the way"):
    """Site ``site`` says it has no Δ for ``round``: a header with ``withheld``, no chunks."""
    return push(c, str(site), round, {}, withheld=why)


def test_the_round_goes_on_without_a_withheld_push_and_averages_the_others() -> None:
    c, records = _coord()
    for s, v in enumerate([0.1, 0.2, 0.3]):
        push(c, str(s), 0, filled(THETA, v))
    assert not records  # the fourth site has not answered yet
    result = _withhold(c, 3, 0)
    assert result.accepted and result.refused == "withheld by the site: lost on the way" and result.payload_bytes == 0
    (rec,) = records
    assert rec.withheld == [{"site": "3", "round": 0, "why": "lost on the way"}]
    assert rec.tokens == 30 and not rec.rejected and "3" not in rec.absent
    # Nesterov SGD, lr 1, momentum 0.9, first step: θ − (1 + 0.9) × mean over the three counted
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.2))


def test_a_round_every_site_withheld_leaves_theta_and_the_momentum_as_they_were() -> None:
    c, records = _coord(sites=2)
    for s in range(2):
        push(c, str(s), 0, filled(THETA, 0.1))
    theta = c.global_params()["w"].clone()
    state = c._checkpoint_state()["outer"]  # noqa: SLF001 - the optimizer state a checkpoint holds
    for s in range(2):
        _withhold(c, s, 1)
    rec = records[1]
    assert rec.rejected and "every push was withheld or refused" in rec.guard and rec.tokens == 0
    assert torch.equal(c.global_params()["w"], theta)
    assert repr(c._checkpoint_state()["outer"]) == repr(state)  # noqa: SLF001
    for s in range(2):  # the run goes on: the next round counts again
        push(c, str(s), 2, filled(THETA, 0.1))
    assert not records[2].rejected


def test_a_withheld_push_counts_for_the_quorum_so_a_majority_round_does_not_wedge() -> None:
    c, records = _coord(sites=4, min_sites=3)
    push(c, "0", 0, filled(THETA, 0.1))
    for s in (1, 2, 3):
        _withhold(c, s, 0)
    (rec,) = records
    assert [w["site"] for w in rec.withheld] == ["1", "2", "3"] and rec.tokens == 10
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.1))


def test_a_repeat_is_a_duplicate_and_a_real_push_after_it_changes_nothing() -> None:
    c, records = _coord(sites=2)
    _withhold(c, 0, 0)
    assert _withhold(c, 0, 0).duplicate
    assert push(c, "0", 0, filled(THETA, 5.0)).duplicate
    push(c, "1", 0, filled(THETA, 0.1))
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.1))
    assert records[0].tokens == 10


def test_a_withheld_push_with_chunks_is_refused_and_changes_nothing() -> None:
    c, records = _coord(sites=2)
    with pytest.raises(CoordinatorError, match="withheld .* yet carries chunks") as e:
        push(c, "0", 0, {"w": torch.ones(8)}, withheld="lost")
    assert e.value.kind == "invalid_argument"
    push(c, "0", 0, filled(THETA, 0.1))  # the site can still push for the round
    push(c, "1", 0, filled(THETA, 0.3))
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.2))


def test_quorum_withheld_zero_counts_a_withheld_site_as_a_zero_delta_with_its_tokens() -> None:
    c, records = _coord(withheld="zero")
    for s, v in enumerate([0.1, 0.2, 0.3]):
        push(c, str(s), 0, filled(THETA, v))
    _withhold(c, 3, 0)
    # Σ tokens·Δ over the three = 10 × 0.6, divided by the tokens of all four (40): 0.15
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.15))
    assert records[0].tokens == 30  # the record still counts the tokens whose Δ counted


def test_quorum_withheld_zero_changes_nothing_under_nonzero_and_nothing_when_all_withheld() -> None:
    c, _ = _coord(withheld="zero", aggregate="nonzero")
    for s, v in enumerate([0.1, 0.2, 0.3]):
        push(c, str(s), 0, filled(THETA, v))
    _withhold(c, 3, 0)
    torch.testing.assert_close(c.global_params()["w"], torch.full((8,), -1.9 * 0.2))  # the mean over the three
    c, records = _coord(sites=2, withheld="zero")
    for s in range(2):
        _withhold(c, s, 0)
    assert records[0].rejected and torch.equal(c.global_params()["w"], THETA["w"])
