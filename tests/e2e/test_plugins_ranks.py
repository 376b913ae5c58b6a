"""The trainer plug-ins on every rank of a site: a standalone ``diloco-coordinator`` (real gRPC
on 127.0.0.1, port 0) and sites that are torchrun groups (gloo, CPU) whose trainer parallelises
the model itself, one run per framework:

* Hugging Face: a ``Trainer`` under torchrun on 2 ranks (it wraps the model in DDP) and a
  one-process ``Trainer`` site, which sends θ₀ (init=site; a multi-rank site never does).
* Lightning: a ``DDPStrategy`` site and a ``ModelParallelStrategy`` site (FSDP2 ``fully_shard``
  in ``configure_model``), both torchrun groups on 2 ranks; θ₀ from a file (init=file).

Each checks: the run's round count; every rank of every site bit-identical to the
coordinator's θ after every round (metrics.jsonl) and at the end (global.json, which also holds
the hash each site reported leaving); each multi-rank site's push in 2 parts, which together
send every parameter's element once (DDP ranks whole tensors, FSDP2 ranks only slices); the
round's tokens summed over the ranks' micro-batches; its loss the site's mean over ranks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import coordinator_records, logs_of, popen_logged, start_coordinator, stop_all, torchrun

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, H = 3, 3  # rounds of H optimizer steps


def _torchrun(script: str, *args: str) -> list[str]:
    return torchrun(2, str(ROOT / "tests" / script), *args, restarts=0)


def _run(tmp_path: Path, coord_args: list[str], sites: dict[str, list[str]]) -> tuple[dict, list[dict], dict[str, dict]]:
    """Starts the coordinator and the sites at once (each site waits for the port file, so its
    imports overlap the coordinator's start), waits for all, stops whatever is left; returns
    global.json, metrics.jsonl's records and each site's result file."""
    procs: list[subprocess.Popen] = []
    try:
        coordinator, port_file = start_coordinator(tmp_path, *coord_args, f"sites={len(sites)}", f"rounds={ROUNDS}", f"sync.every={H}")
        procs.append(coordinator)
        for site, cmd in sites.items():
            out = ["--site-id", site, "--port-file", str(port_file), "--out", str(tmp_path / f"{site}.json")]
            procs.append(popen_logged([*cmd, *out], tmp_path / f"{site}.log", cwd=ROOT))
        deadline = time.monotonic() + 120
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, logs_of(tmp_path)
    finally:
        stop_all(procs)
    final, metrics = coordinator_records(tmp_path)
    results = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in sites}
    return final, metrics, results


def _check_run(final: dict, metrics: list[dict], results: dict[str, dict], params: int) -> None:
    """What every run must leave behind, whatever the framework."""
    assert final["rounds_committed"] == ROUNDS and [m["round"] for m in metrics] == list(range(ROUNDS))
    assert final["params"] == params
    every_round = {str(m["round"]): m["global_sha256"] for m in metrics}
    for site, r in results.items():
        assert r["rounds"] == ROUNDS and r["global_step"] == ROUNDS * H, site  # stopped after the last round
        assert r["round_sha256"] == every_round, site  # bit-identical to the coordinator after every round
        assert r["rank_sha256"] == [final["global_sha256"]] * r["world_size"], site  # every rank, at the end
    assert final["site_reported_sha256"] == {s: final["global_sha256"] for s in results}
    for m in metrics:
        assert m["participants"] == sorted(results) and m["inner_steps"] == H * len(results)
        assert sorted(m["sliced"]) == sorted(s for s, r in results.items() if r["world_size"] > 1)
        for site, parts in m["sliced"].items():
            assert [p["part"] for p in parts] == [0, 1], site
            assert all(p["numel"] > 0 for p in parts) and sum(p["numel"] for p in parts) == params, site  # each rank its share, once


# ---- Hugging Face Trainer: DDP on 2 ranks and a one-process site ---------------------------


def test_hf_trainer_ddp_site_and_one_process_site(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hf_ranks_site import ACCUMULATE, BATCH, CONTEXT, PAD

    final, metrics, results = _run(
        tmp_path,
        ["init=site"],
        {"ddp": _torchrun("hf_ranks_site.py", "--seed", "1"), "one": [sys.executable, str(ROOT / "tests" / "hf_ranks_site.py"), "--seed", "2"]},
    )
    _check_run(final, metrics, results, params=results["one"]["params"])
    assert final["init_from"] == "site 'one'"  # a multi-rank site never sends θ₀
    assert results["ddp"]["world_size"] == 2 and results["ddp"]["model"] == results["one"]["model"] == "GPT2LMHeadModel"
    per_rank = H * ACCUMULATE * BATCH * (CONTEXT - PAD)  # the attention mask's ones of a round's micro-batches, per rank
    for m in metrics:
        parts = m["sliced"]["ddp"]
        assert all(p["sliced"] == 0 and p["whole"] > 0 for p in parts)  # DDP ranks split the tensors, whole
        assert m["tokens"] == 2 * per_rank + per_rank  # the DDP site's two ranks summed, and the one-process site
        # The Trainer logs, on every rank, the loss averaged over its ranks (logging_steps = H):
        # the round's loss is that, token-weighted with the other site's.
        step = str((m["round"] + 1) * H)
        ddp, one = results["ddp"]["losses"][step], results["one"]["losses"][step]
        assert math.isfinite(m["train_loss"]) and m["train_loss"] == pytest.approx((2 * ddp + one) / 3, rel=1e-6)


# ---- Lightning: DDPStrategy and ModelParallelStrategy (FSDP2), each on 2 ranks -------------


def test_lightning_ddp_and_fsdp2_sites(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning_ranks_site import ACCUMULATE, BATCH, CONTEXT, TinyLM

    theta0 = {n: p.detach().clone() for n, p in TinyLM(seed=0).named_parameters()}
    torch.save(theta0, tmp_path / "theta0.pt")
    final, metrics, results = _run(
        tmp_path,
        ["init=file", f"init.path={tmp_path / 'theta0.pt'}"],
        {"ddp": _torchrun("lightning_ranks_site.py", "--strategy", "ddp"), "fsdp2": _torchrun("lightning_ranks_site.py", "--strategy", "model_parallel")},
    )
    _check_run(final, metrics, results, params=sum(t.numel() for t in theta0.values()))
    assert results["ddp"]["strategy"] == "DDPStrategy" and results["fsdp2"]["strategy"] == "ModelParallelStrategy"
    per_rank = H * ACCUMULATE * BATCH * CONTEXT  # the token ids of a round's micro-batches, per rank
    per_round = H * ACCUMULATE  # micro-batches per round, per rank
    for m in metrics:
        assert all(p["sliced"] == 0 and p["whole"] > 0 for p in m["sliced"]["ddp"])  # DDP: whole tensors, split among the ranks
        assert all(p["whole"] == 0 and p["sliced"] > 0 for p in m["sliced"]["fsdp2"])  # FSDP2: only each rank's slices
        assert m["tokens"] == 2 * 2 * per_rank
        # Each site's loss is the mean over its ranks of what training_step returned; the
        # sites trained on as many tokens, so the round's loss is the mean of the two.
        r = m["round"]
        means = [sum(sum(losses[r * per_round : (r + 1) * per_round]) for losses in res["rank_losses"]) / (2 * per_round) for res in results.values()]
        assert m["train_loss"] == pytest.approx(sum(means) / 2, rel=1e-5)
