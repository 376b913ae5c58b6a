"""Inner layouts through the real simulation: every site a torchrun group (gloo on CPU), each
rank pushing and pulling its own slices over real gRPC.

* Per layout (ddp2 with activation checkpointing, tp2_fsdp2) and per set of degrees the
  names do not cover (pipeline stages sharded by FSDP2, HSDP), one round of a site
  gives the same θ as the single layout on the same data (to 1e-5 of the update's norm: only
  the order of float reductions differs).
* The coordinator's record of what each part of a sharded push held: FSDP2 ranks send only
  slices (never a whole tensor of a sharded parameter), DDP ranks split the tensors, and every
  element is sent once, by one of the ranks holding it (FoundModel shares the replicas' work).
* Sites with different layouts in one run end bit-identical to the coordinator, also when
  one of them (a torchrun group) is killed mid push and started again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Run, processes_of, run_ok

from diloco import checkpoint as ck
from diloco.model import build_model, count_params, model_config
from diloco.site.layouts.build import init_site_group
from diloco.site.layouts.config import LayoutConfig, ParallelDims

pytestmark = pytest.mark.timeout(300)

BASE = ["sites=1", "sync.every=3", "rounds=1", "data.batch_size=4", "eval_every=100"]  # one site: fewer processes
PARAMS = count_params(build_model(model_config("tiny"), 0))
TENSORS = len(list(build_model(model_config("tiny"), 0).parameters()))


def _final_theta(run: Run) -> dict[str, torch.Tensor]:
    """θ in the coordinator's last checkpoint of ``run``."""
    loaded = ck.load_latest(run.run_dir / "checkpoints" / "coordinator")
    assert loaded is not None
    return loaded.state["outer"]["params"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_ok(tmp_path_factory.mktemp("single") / "run", *BASE, "layout=single")


# id -> (overrides, the name the site's record gives, its ranks). fsdp2, tp2 and pp2 alone are
# not here: every layout is one code path (MeshModel), hsdp, tp2_fsdp2 and pp2+dp_shard2 match
# the single layout with FSDP2, tensor and pipeline parallelism in them, and the mixed run below
# has tp2, fsdp2 and pp2 sites bit-identical to the coordinator.
LAYOUTS = {
    "tp2_fsdp2": (["layout=tp2_fsdp2"], "tp2_fsdp2", 4),
    # degrees beyond the names: two pipeline stages, each sharded over 2 ranks; HSDP
    "pp2+dp_shard2": (["layout=pp2", "parallel.dp_shard=2"], "pp2_dp_shard2", 4),
    # HSDP, recomputing activations in backward (its replicas are ddp2's: one code path)
    "hsdp+ac": (["parallel.dp_replicate=2", "parallel.dp_shard=2", "layout.activation_checkpointing=true"], "dp_replicate2_dp_shard2", 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_round_matches_the_single_layout(single: Run, layout: str, tmp_path: Path) -> None:
    overrides, name, ranks = LAYOUTS[layout]
    run = run_ok(tmp_path / "run", *BASE, *overrides, timeout=240)
    assert run.summary["hashes_equal"]
    assert not processes_of(run.run_dir), "a rank outlived the run"
    a, b = _final_theta(single), _final_theta(run)
    start = {n: p.detach() for n, p in build_model(model_config("tiny"), 0).named_parameters()}
    diff = sum(float(((a[n] - b[n]) ** 2).sum()) for n in a) ** 0.5
    update = sum(float(((a[n] - start[n]) ** 2).sum()) for n in a) ** 0.5
    assert diff <= 1e-5 * update, (diff, update)
    site = run.metrics[0]["sliced"]["0"]
    assert [p["part"] for p in site] == list(range(ranks))
    assert sum(p["numel"] for p in site) == PARAMS  # every element sent once
    split = 7 * model_config("tiny").n_layers  # the matrices of the blocks that tensor parallelism splits
    if layout in ("hsdp+ac", "pp2+dp_shard2"):
        # every parameter is sharded on its rows: no rank sends a whole tensor
        assert all(p["whole"] == 0 for p in site), site
        if layout == "pp2+dp_shard2":  # the two ranks of a stage send halves of it (the stages differ in size)
            assert site[0]["numel"] == site[1]["numel"] and site[2]["numel"] == site[3]["numel"], site
        else:  # the ranks share the work
            assert all(abs(p["numel"] - PARAMS / ranks) < 0.1 * PARAMS / ranks for p in site), site
        assert all(p["sliced"] > 0 for p in site), site
    else:
        assert layout == "tp2_fsdp2", layout
        # every tensor is split (FSDP over the pairs); what both ranks of a pair hold alike
        # (norms, embedding: split only by FSDP) one of them sends
        assert [p["whole"] for p in site] == [0, 0, 0, 0], site
        assert all(p["sliced"] >= split for p in site) and sum(p["sliced"] for p in site) == 2 * TENSORS + 2 * split, site
    workers = run.workers()
    assert all(w["layout"] == name and w["ranks"] == ranks and len(w["bytes_up_per_rank"]) == ranks for w in workers.values())


def test_sites_with_different_layouts_train_one_model(tmp_path: Path) -> None:
    # The fsdp2 site's leader rank is SIGKILLed in the middle of its push in round 1: its
    # torchrun group goes down, the simulator starts it again, and it redoes round 1.
    kill = "faults.events=[{kind:kill_site,site:1,at_round:1,phase:push,restart_after_s:0.5}]"
    # quorum.min_sites=4: round 0 waits for every site (a torchrun site that starts late would miss it under the majority quorum)
    overrides = [
        "sites=4",
        "sync.every=2",
        "rounds=2",
        "data.batch_size=4",
        "eval_every=100",
        "site_layouts=[tp2,fsdp2,pp2,single]",
        "quorum.min_sites=4",
        kill,
    ]
    run = run_ok(tmp_path / "run", *overrides, timeout=240)
    summary = run.summary
    assert [(e["process"], e["round"], e["phase"]) for e in summary["faults_injected"]] == [("site 1", 1, "push")]
    assert run.json("workers/1.json")["incarnation"] == 1  # the restarted group joined again and finished the run
    assert summary["hashes_equal"] and len(summary["site_global_sha256"]) == 4
    assert [m["round"] for m in run.metrics] == [0, 1]
    for m in run.metrics:
        assert m["participants"] == ["0", "1", "2", "3"] and sorted(m["sliced"]) == ["0", "1", "2"]
    workers = run.workers()
    assert {s: w["layout"] for s, w in workers.items()} == {"0": "tp2", "1": "fsdp2", "2": "pp2", "3": "single"}
    # a rank pulls only its own rows (fp32 payloads are cut to them): about half of θ each
    fsdp = workers["1"]["bytes_down_per_rank"]
    assert all(b < 0.6 * workers["3"]["bytes_down"] for b in fsdp), fsdp


def test_a_layout_needs_its_ranks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"layout fsdp2 needs 2 rank\(s\); this site was launched with 1 \(start it with torchrun --nproc-per-node=2\)"):
        init_site_group(ParallelDims.named("fsdp2"))
    # the console script, started without torchrun, says so before it connects anywhere
    site = Path(sys.executable).parent / "diloco-site"
    args = [str(site), "layout=tp2_fsdp2", "site.id=0", "site.coordinator=127.0.0.1:1", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "layout tp2_fsdp2 needs 4 rank(s); this site was launched with 1" in done.stderr, done.stderr


def test_unknown_layouts_are_named() -> None:
    with pytest.raises(ValueError, match="layout='tp9': unknown; known layouts: single, ddp2, fsdp2, tp2, pp2, tp2_fsdp2"):
        LayoutConfig(name="tp9")


@pytest.mark.timeout(200)
def test_a_hugging_face_llama_with_tensor_parallelism(tmp_path: Path) -> None:
    # model=hf with the ready Llama plan (diloco.site.layouts.hf_llama) over 2 tp ranks: q/k/v/o
    # and gate/up/down split, the embedding and the norms whole on both; the site ends with θ
    # bit-identical to the coordinator's
    pytest.importorskip("transformers")
    overrides = ["model=hf", "model.parallelize=diloco.site.layouts.hf_llama:parallelize", "parallel.tp=2"]
    run = run_ok(tmp_path / "run", *BASE, *overrides, timeout=180)
    assert run.summary["hashes_equal"] and run.summary["rounds_committed"] == 1
    layers = 2  # conf/model/hf.yaml
    site = run.metrics[0]["sliced"]["0"]
    assert [p["sliced"] for p in site] == [7 * layers, 7 * layers], site  # every rank sends its part of the 7 matrices
    assert sum(p["whole"] for p in site) == 1 + 2 * layers + 1, site  # the embedding and the norms, once
    assert [w["layout"] for w in run.workers().values()] == ["tp2"]
