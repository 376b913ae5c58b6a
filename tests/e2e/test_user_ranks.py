"""A user's own multi-rank trainer as a site: ``DiLoCo(...)`` on every rank of torchrun groups
(gloo, CPU) that parallelise an MLP the project does not know in every way torch offers, in
one run against a real ``diloco-coordinator`` over real gRPC, θ₀ sent by the FSDP2 site (init=site),
each of its ranks sending its rows.

One run, four sites (tests/user_ranks_site.py): FSDP2 ``fully_shard`` on 2 ranks
(rank 1 SIGKILLed in round 1's last step: torchrun restarts the group and the site rejoins);
tensor parallel ``parallelize_module`` on 2 ranks; a 2-D mesh (dp_shard 2 x tp 2) on 4 ranks;
two pipeline stages by hand. Once the FSDP2 site has sent θ₀, the bad sites of
tests/user_ranks_refusals.py are each refused, naming what is wrong, while the others train.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import address_of, coordinator_records, logs_of, popen_logged, start_coordinator, stop_all, torchrun, wait_for_log
from user_ranks_site import build

from diloco.outer import params_sha256

pytestmark = pytest.mark.timeout(240)

SITES = {"fsdp": ("fsdp", 2), "tp": ("tp", 2), "mesh2d": ("tp_fsdp", 4), "pp": ("pp", 2)}  # DDP and one-process sites: test_plugins_ranks.py
ROUNDS, H, BATCH = 2, 4, 16  # FSDP2's rank 1 is killed in round 1, the last
PARAMS = sum(p.numel() for p in build(0).parameters())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("ranks")
    coordinator, port_file = start_coordinator(d, "init=site", f"sites={len(SITES)}", f"rounds={ROUNDS}", f"sync.every={H}")
    procs, sites = [coordinator], {}
    try:
        address = address_of(coordinator, port_file)

        def start(site: str) -> None:
            how, ranks = SITES[site]
            args = ["--parallel", how, "--coordinator", address, "--site-id", site, "--seed", str(list(SITES).index(site)), "--sync-every", str(H)]
            args += ["--batch", str(BATCH), "--out", str(d / f"{site}.json")]
            if site == "fsdp":
                args += ["--kill-rank", "1", "--kill-round", "1"]
            sites[site] = popen_logged(torchrun(ranks, "user_ranks_site.py", *args), d / f"{site}.log")
            procs.append(sites[site])

        # The FSDP2 site joins first and sends θ₀ (init=site), slice by slice from its 2 ranks.
        start("fsdp")
        wait_for_log(d, "coord.log", "θ₀ received from site 'fsdp'", sites["fsdp"])
        # The bad sites beside the good ones: a refused site never counts (round 0 cannot close
        # before every good site pushed, and starts from θ₀).
        refusals = popen_logged(torchrun(2, "user_ranks_refusals.py", "--coordinator", address, "--out", str(d / "refusals.json")), d / "refusals.log")
        procs.append(refusals)
        # Its one case the coordinator judges (a tensor no rank holds) goes first, while the run
        # has a free site slot: once the good sites have all joined, "all taken" comes first.
        wait_for_log(d, "refusals.log", "case held_by_no_rank done", refusals)
        for site in SITES:
            if site != "fsdp":
                start(site)
        for p in [refusals, *sites.values(), coordinator]:
            assert p.wait(timeout=180) == 0, logs_of(d)
    finally:
        stop_all(procs)
    final, metrics = coordinator_records(d)
    return {
        "theta0_sha256": params_sha256(dict(build(list(SITES).index("fsdp")).named_parameters())),
        "refusals": json.loads((d / "refusals.json").read_text()),
        "final": final,
        "metrics": metrics,
        "sites": {s: json.loads((d / f"{s}.json").read_text()) for s in SITES},
    }


def test_every_site_holds_the_coordinators_theta_after_every_round(run: dict[str, Any]) -> None:
    metrics, final = run["metrics"], run["final"]
    assert [m["round"] for m in metrics] == list(range(ROUNDS)) and final["rounds_committed"] == ROUNDS
    by_round = {str(m["round"]): m["global_sha256"] for m in metrics}
    for site, result in run["sites"].items():
        # the whole model (DTensors gathered with full_tensor(), the stages united) after each round
        hashes = result["round_sha256"]
        first = 1 if site == "fsdp" else 0  # the restarted group started from round 0's θ
        assert hashes["start"] == (run["theta0_sha256"] if first == 0 else by_round["0"]), site
        assert {r: h for r, h in hashes.items() if r != "start"} == {r: h for r, h in by_round.items() if int(r) >= first}, site
        assert result["global_sha256"] == final["global_sha256"], site
    assert final["init_from"] == "site 'fsdp'"  # θ₀ from the 2-rank site, each rank its rows
    assert run["sites"]["fsdp"]["restarts"] == 1  # torchrun restarted the killed group once
    assert all(r["restarts"] == 0 for s, r in run["sites"].items() if s != "fsdp")


def test_each_rank_sends_its_share_and_the_site_one_model(run: dict[str, Any]) -> None:
    for m in run["metrics"]:
        assert sorted(m["participants"]) == sorted(SITES)
        # tokens summed over each site's ranks, counted once per sample: BATCH per step everywhere
        assert m["tokens"] == len(SITES) * H * BATCH, m["tokens"]
        for site, parts in m["sliced"].items():
            _, ranks = SITES[site]
            assert [p["part"] for p in parts] == list(range(ranks)), (site, parts)
            assert sum(p["numel"] for p in parts) == PARAMS, (site, parts)  # every element sent once
        assert sorted(m["sliced"]) == sorted(s for s, (_, ranks) in SITES.items() if ranks > 1)
    for site, result in run["sites"].items():
        pushed = [r["pushed"] for r in result["ranks"]]
        assert len(pushed) == SITES[site][1] and sum(pushed) == PARAMS, (site, pushed)
    # sharded sites split the work about evenly; FSDP2 sends no whole tensor but the tiny last layer's
    fsdp = run["metrics"][0]["sliced"]["fsdp"]
    assert all(abs(p["numel"] - PARAMS / 2) < 0.05 * PARAMS for p in fsdp), fsdp
    assert sum(p["whole"] for p in fsdp) == 2  # 4.weight [1, 64] and 4.bias [1]: one row, on rank 0
    # the pipeline's stages push what they hold: layers 0-3 and layer 4
    assert [p["numel"] for p in run["metrics"][0]["sliced"]["pp"]] == [PARAMS - 65, 65]


def test_bad_sites_are_refused_before_their_first_push_naming_what_is_wrong(run: dict[str, Any]) -> None:
    refused = run["refusals"]
    expected = {
        "two_site_ids": "given different site_id (rank 0: 'site-0'; rank 1: 'site-1')",
        "two_sync_every": "given different sync_every (rank 0: 4; rank 1: 5)",
        "shapes_disagree": "the ranks disagree on parameter '0.bias' (rank 0: [64] float32; rank 1: [32] float32)",
        "overlap": "parameter '0.weight' of shape [64, 16] is not held exactly once by the site's ranks: slices [0:32, 0:16] and [0:64, 0:16] overlap",
        "gap": "slices [0:32, 0:16] cover 512 of 1024 elements (a gap) ([0:32, 0:16] on rank 0)",
        "partial": "rank 1 of the site: parameter '0.weight' has a Partial placement",
        "fsdp1": "is a flat parameter of FullyShardedDataParallel (FSDP1)",
        "held_by_no_rank": "does not match the coordinator's (θ₀ from site 'fsdp')",
    }
    assert sorted(refused) == sorted(expected)
    for case, says in expected.items():
        assert len(refused[case]) == 2, case  # both ranks raised: neither waits for the other
        for rank_said in refused[case]:
            assert says in rank_said, (case, rank_said)
    assert "missing parameter '4.bias'" in refused["held_by_no_rank"][1]  # rank 1 says what rank 0 was told
    # θ unchanged by all of it: round 0 started from θ₀ and counted the good sites only
    assert run["sites"]["tp"]["round_sha256"]["start"] == run["theta0_sha256"]
    assert "bad" not in run["metrics"][0]["participants"]
