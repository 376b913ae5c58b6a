"""A torchtitan training job as a site, on a CPU: tests/titan_site.py's loop around torchtitan's
own llama3 debugmodel (2 of its blocks), ``parallelize_llama``, ``ParallelDims`` meshes and
loss, under torchrun (gloo), through ``DiLoCo(...)`` on every rank, against a real
``diloco-coordinator`` over real gRPC on 127.0.0.1. Two sites in one run: FSDP2 (dp_shard 2),
which sends θ₀ slice by slice (init=site), tensor parallel (tp 2), and one rank (torchtitan
still makes its parameters DTensors: FSDP2 of degree 1, as on scripts/gpu_check.sh's one GPU). torchtitan's Trainer
itself needs a GPU (scripts/gpu_check.sh runs it); docs/torchtitan.md says where it stops here.

Skipped, naming what is missing, without torchtitan and its dependencies (the torchtitan extra).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from helpers import address_of, coordinator_records, logs_of, popen_logged, start_coordinator, stop_all, torchrun, wait_for_log

pytestmark = pytest.mark.timeout(150)

try:  # what the site imports: torchtitan's model code and its Trainer's config (datasets, torchdata, triton, ...)
    import torchtitan.models.llama3  # noqa: F401
    import torchtitan.trainer  # noqa: F401
except ImportError as e:
    pytest.skip(f"torchtitan is not importable ({e}): pip install diloco[torchtitan]", allow_module_level=True)

SITES = {"fsdp": ("--dp-shard", 2), "tp": ("--tp", 2), "one": ("--dp-shard", 1)}  # the flag's degree: the site's ranks
ROUNDS, H, BATCH, SEQ, LAYERS = 3, 2, 2, 64, 2


def _params() -> int:
    import torch
    from titan_site import model_config

    with torch.device("meta"):
        return sum(p.numel() for p in model_config(LAYERS, "sdpa").build().parameters())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("titan")
    t0 = time.monotonic()
    coordinator, port_file = start_coordinator(d, "init=site", f"sites={len(SITES)}", f"rounds={ROUNDS}", f"sync.every={H}")
    procs = [coordinator]
    try:
        address = address_of(coordinator, port_file)
        for seed, (site, (flag, degree)) in enumerate(SITES.items()):
            args = [flag, str(degree), "--layers", str(LAYERS), "--batch", str(BATCH), "--seq-len", str(SEQ), "--sync-every", str(H)]
            args += ["--coordinator", address, "--site-id", site, "--seed", str(seed), "--dump", str(d / site), "--out", str(d / f"{site}.json")]
            procs.append(
                popen_logged(torchrun(degree, "titan_site.py", *args, restarts=0, one_plain=False), d / f"{site}.log")
            )  # torchtitan's meshes need a group
            if site == "fsdp":  # it joins first and sends θ₀ (init=site), each rank its rows
                wait_for_log(d, "coord.log", "θ₀ received from site 'fsdp'", procs[-1])
        for p in [*procs[1:], coordinator]:
            assert p.wait(timeout=120) == 0, logs_of(d)
    finally:
        stop_all(procs)
    final, metrics = coordinator_records(d)
    return {"final": final, "metrics": metrics, "sites": {s: json.loads((d / f"{s}.json").read_text()) for s in SITES}, "wall_s": time.monotonic() - t0}


def test_every_round_the_sites_hold_the_coordinators_theta(run: dict[str, Any]) -> None:
    metrics, final = run["metrics"], run["final"]
    assert [m["round"] for m in metrics] == list(range(ROUNDS)) and final["rounds_committed"] == ROUNDS
    assert final["init_from"] == "site 'fsdp'"
    by_round = {str(m["round"]): m["global_sha256"] for m in metrics}
    starts = {site: result["round_sha256"]["start"] for site, result in run["sites"].items()}
    assert starts["tp"] == starts["one"] == starts["fsdp"]  # the other sites (other seeds) started from the θ₀ the fsdp site sent
    for site, result in run["sites"].items():
        # the whole model (DTensors gathered with full_tensor()) after each round, on every rank alike
        assert {r: h for r, h in result["round_sha256"].items() if r != "start"} == by_round, site
        assert result["global_sha256"] == final["global_sha256"], site
        assert result["rounds"] == ROUNDS and len(result["losses"]) == ROUNDS * H


def test_each_rank_pushes_its_share_of_torchtitans_parameters(run: dict[str, Any]) -> None:
    params = _params()
    for site, result in run["sites"].items():
        pushed = [r["pushed"] for r in result["ranks"]]
        assert len(pushed) == SITES[site][1] and sum(pushed) == params, (site, pushed)
        assert all(p > params / 4 for p in pushed), (site, pushed)  # both ranks carry a real share
        # torchtitan's own placements: FSDP2 rows; tensor parallel on a (fsdp 1, tp 2) mesh
        placements = result["placements"]
        assert "Shard(dim=0)" in placements["layers.0.attention.qkv_linear.wqkv.weight"], placements
    assert "Shard(dim=1)" in run["sites"]["tp"]["placements"]["layers.0.attention.wo.weight"]  # row-wise
    for m in run["metrics"]:
        assert sorted(m["participants"]) == sorted(SITES)
        assert m["tokens"] == H * (2 * BATCH * SEQ + BATCH * SEQ + BATCH * SEQ)  # fsdp: 2 ranks' batches; tp: one batch, counted once; one
        for site, parts in m["sliced"].items():
            assert [p["part"] for p in parts] == [0, 1] and sum(p["numel"] for p in parts) == params, (site, parts)
        assert sorted(m["sliced"]) == ["fsdp", "tp"]  # the one-rank site pushes whole tensors
        assert m["train_loss"] is not None and 6.0 < m["train_loss"] < 9.0  # about ln(2048) = 7.6 on random tokens
