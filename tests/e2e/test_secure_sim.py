"""The default simulation runs on the secure path (TLS, client certificates and tokens from
its own run CA) and, with the default quorum (a majority), finishes without a site that died
for good."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_ok

pytestmark = pytest.mark.timeout(300)


def test_a_four_site_tls_run_with_a_site_killed_for_good_finishes_with_the_default_quorum(tmp_path: Path) -> None:
    run = run_ok(
        tmp_path / "run", "sites=4", "rounds=4", "sync.every=5", "eval_every=4", "quorum.lease_s=3",
        "faults.events=[{kind:kill_site,site:3,at_round:1,phase:inner,restart_after_s:-1}]", timeout=240,
    )  # fmt: skip
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["rounds_committed"] == 4 and summary["hashes_equal"]
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["security"] == {"dir": str(run.run_dir / "credentials"), "tls": True, "auth": "both", "insecure": False, "server_name": None}
    assert sorted(p.name for p in (run.run_dir / "credentials" / "sites").glob("*.token")) == ["0.token", "1.token", "2.token", "3.token"]
    lines = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "3" in {s for m in lines for s in m["evicted"]}
    assert all(m["participants"] == ["0", "1", "2"] for m in lines[2:])  # went on without it
    assert json.loads((run.run_dir / "global.json").read_text())["min_sites"] == 3  # the default quorum: a majority of 4


def test_a_poisoning_site_is_refused_named_and_the_run_goes_on(tmp_path: Path) -> None:
    run = run_ok(
        tmp_path / "run", "sites=3", "rounds=4", "sync.every=5", "eval_every=4", "robust.norm_ratio=3", "robust.min_history=2",
        "faults.events=[{kind:poison_push,site:2,factor:50,at_round:1}]", timeout=240,
    )  # fmt: skip
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["refused_pushes"] == {"2": 3} and summary["rounds_committed"] == 4 and summary["hashes_equal"]
    lines = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "refused" not in lines[0]
    for m in lines[1:]:
        (refused,) = m["refused"]
        assert refused["site"] == "2" and refused["norm"] > 3 * refused["reference"] and "exceeds 3 ×" in refused["why"]
        assert m["tokens"] * 3 == lines[0]["tokens"] * 2 and m["participants"] == ["0", "1", "2"]  # counted: two of three
    assert json.loads((run.run_dir / "global.json").read_text())["refused_pushes"] == {"2": 3}  # the coordinator's own count, by site
    uncounted = json.loads((run.run_dir / "workers" / "2.json").read_text())["uncounted"]
    assert sorted(uncounted) == ["1", "2", "3"] and all(why.startswith("not counted: ") and "exceeds 3 ×" in why for why in uncounted.values()), uncounted


def test_a_site_whose_inner_phase_diverges_withholds_that_round_and_trains_on_from_theta(tmp_path: Path) -> None:
    # int8 with error feedback: the NaN must reach neither the residual nor the next rounds.
    run = run_ok(
        tmp_path / "run", "sites=3", "rounds=4", "sync.every=6", "eval_every=4", "codec=int8",
        "faults.events=[{kind:diverge_site,site:2,at_round:1}]", timeout=240,
    )  # fmt: skip
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["rounds_committed"] == 4 and summary["hashes_equal"]
    lines = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    (withheld,) = lines[1]["withheld"]
    assert withheld["site"] == "2" and "not finite" in withheld["why"] and "diverged" in withheld["why"]
    assert lines[1]["tokens"] * 3 == lines[0]["tokens"] * 2 and not lines[1]["rejected"]  # the other two counted
    for m in (lines[0], *lines[2:]):  # before and after: every site counted, θ finite
        assert not m.get("withheld") and not m["rejected"] and m["participants"] == ["0", "1", "2"] and m["tokens"] == lines[0]["tokens"]
    assert all(m["update_norm"] < 1e3 for m in lines) and summary["final_eval_bpb"] < 10
    worker = json.loads((run.run_dir / "workers" / "2.json").read_text())
    assert worker["diverged_rounds"] == [1] and worker["dropped_rounds"] == []
    assert worker["round_sha256"] == {str(m["round"]): m["global_sha256"] for m in lines}  # it trained on from θ, every round
